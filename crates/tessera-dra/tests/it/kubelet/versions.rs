//! A kubelet speaking only v1beta1; a claim with a fraction of each of two GPUs.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_speaking_only_v1beta1_gets_the_same_answers() {
    use tessera_dra::proto::dra_v1beta1 as beta;
    let mut node = Node::start();
    let uid = "uid-beta0000";
    node.api
        .put_claim(claim("beta", uid, "gpu-0", Some(("30", "20Gi"))));
    node.start_plugin();
    let mut v1 = node.kubelet_register().await;
    let reg = connect_unix(&node.registration_socket(), Duration::from_secs(5))
        .await
        .unwrap();
    let info = RegistrationClient::new(reg)
        .get_info(InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.supported_versions, [DRA_V1, DRA_V1BETA1]);
    let ch = connect_unix(Path::new(&info.endpoint), Duration::from_secs(5))
        .await
        .unwrap();
    let mut k = beta::dra_plugin_client::DraPluginClient::new(ch);
    let claims = vec![beta::Claim {
        namespace: "team-a".into(),
        uid: uid.into(),
        name: "beta".into(),
    }];
    let r = within(
        20,
        "v1beta1 NodePrepareResources",
        k.node_prepare_resources(beta::NodePrepareResourcesRequest {
            claims: claims.clone(),
        }),
    )
    .await
    .unwrap()
    .into_inner()
    .claims;
    assert_eq!(r[uid].error, "");
    // The same devices as through v1 (which also carries the share id).
    let through_v1 = prepare(&mut v1, &[kclaim("beta", uid)]).await;
    let d1 = &through_v1[uid].devices[0];
    let d = &r[uid].devices[0];
    assert_eq!(
        (
            &d.request_names,
            &d.pool_name,
            &d.device_name,
            &d.cdi_device_ids
        ),
        (
            &d1.request_names,
            &d1.pool_name,
            &d1.device_name,
            &d1.cdi_device_ids
        )
    );
    assert_eq!(node.claim_allocations(uid).len(), 1);
    assert_eq!(node.claim_allocations(uid)[0].share, 30);
    let u = within(
        20,
        "v1beta1 NodeUnprepareResources",
        k.node_unprepare_resources(beta::NodeUnprepareResourcesRequest { claims }),
    )
    .await
    .unwrap()
    .into_inner()
    .claims;
    assert_eq!(u[uid].error, "");
    assert!(node.claim_allocations(uid).is_empty());
    assert!(node.files("cdi").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_with_a_fraction_of_each_of_two_gpus_becomes_one_multi_gpu_allocation() {
    let mut node = Node::start();
    let uid = "uid-tp000000";
    // Tensor parallelism 2: one request for two devices, a result on each GPU with its own
    // consumed capacity.
    let mut c = claim("tp2", uid, "gpu-0", Some(("30", "20Gi")));
    c["spec"]["devices"]["requests"][0]["exactly"]["count"] = json!(2);
    let mut second = c["status"]["allocation"]["devices"]["results"][0].clone();
    second["device"] = json!("gpu-1");
    second["consumedCapacity"] = json!({"shares": "30", "memory": "10Gi"});
    second["shareID"] = json!("uid-tp01-0000-4000-8000-000000000001");
    c["status"]["allocation"]["devices"]["results"]
        .as_array_mut()
        .unwrap()
        .push(second);
    node.api.put_claim(c);
    node.start_plugin();
    let mut k = node.kubelet_register().await;
    let (gpu0, gpu1) = (node.gpu_uuid(0), node.gpu_uuid(1));
    let r = prepare(&mut k, &[kclaim("tp2", uid)]).await;
    assert_eq!(r[uid].error, "");
    let nvidia: Vec<&str> = r[uid]
        .devices
        .iter()
        .map(|d| d.cdi_device_ids[1].as_str())
        .collect();
    assert_eq!(
        nvidia,
        [
            format!("nvidia.com/gpu={gpu0}"),
            format!("nvidia.com/gpu={gpu1}")
        ]
    );
    // One allocation per GPU with that GPU's limit, tied into one group.
    let mut allocs = node.claim_allocations(uid);
    allocs.sort_by_key(|a| a.gpu_index);
    let limits: Vec<(String, u32, u64)> = allocs
        .iter()
        .map(|a| (a.gpu_uuid.clone(), a.share, a.memory_limit))
        .collect();
    assert_eq!(
        limits,
        [(gpu0.clone(), 30, 20 * GIB), (gpu1.clone(), 30, 10 * GIB)]
    );
    let group = &allocs[0].labels[tessera_protocol::group::LABEL_GPU_GROUP];
    assert_eq!(
        &allocs[1].labels[tessera_protocol::group::LABEL_GPU_GROUP],
        group
    );
    // The CDI spec makes both GPUs visible and mounts one identity: the group token, which
    // reaches GPU 0's slice, and GPU 1's through its derived token.
    let spec = read_spec(&node, uid);
    assert!(
        spec.container_edits
            .env
            .contains(&format!("CUDA_VISIBLE_DEVICES={gpu0},{gpu1}")),
        "{spec:?}"
    );
    let ident = spec
        .container_edits
        .mounts
        .iter()
        .find(|m| m.container_path == "/etc/tessera/tenant")
        .expect("identity mounted");
    let id = Identity::read(Path::new(&ident.host_path))
        .unwrap()
        .unwrap();
    let t0 = tessera_protocol::client::TenantClient::connect(&node.spec.socket, &id.token).unwrap();
    assert_eq!(
        (
            t0.allocation().gpu_uuid.as_str(),
            t0.allocation().memory_limit
        ),
        (gpu0.as_str(), 20 * GIB)
    );
    let t1 = tessera_protocol::client::TenantClient::connect(
        &node.spec.socket,
        &tessera_protocol::group::slice_token(&id.token, &gpu1),
    )
    .unwrap();
    assert_eq!(
        (
            t1.allocation().gpu_uuid.as_str(),
            t1.allocation().memory_limit
        ),
        (gpu1.as_str(), 10 * GIB)
    );
    drop((t0, t1));
    // Unprepared whole.
    assert_eq!(unprepare(&mut k, &[kclaim("tp2", uid)]).await, [""]);
    assert!(node.claim_allocations(uid).is_empty());
}
