//! The real `tessera-arbiter` binary, driven over its sockets.
//!
//! - `lifecycle`: allocations created, listed, deleted; sockets, exit codes, logs; racing
//!   reserves and a killed process's memory.
//! - `wire`: versions, bad input, labels, deleted allocations, restarts.
//! - `pressure`: credit taken back from siblings before a refusal.
//! - `limits`: the limit against forged releases, redeclares and trailing bytes; a state file
//!   breaking the rules.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use crate::common::*;
use tessera_protocol::client::{AdminClient, ClientError, TenantClient};
use tessera_protocol::frame;
use tessera_protocol::{
    AdminErrorKind, AdminRequest, CreateAllocation, GpuSelector, Hello, PROTOCOL_VERSION,
    RefusalKind, Role, ServerHello, TenantReply, TenantRequest,
};

fn create(admin: &mut AdminClient, gpu: u32, limit: u64, share: u32) -> (String, String) {
    let (token, a) = admin
        .create(CreateAllocation {
            gpu: GpuSelector::Index(gpu),
            memory_limit: limit,
            share,
            cap: None,
            labels: BTreeMap::new(),
        })
        .unwrap();
    (token, a.id)
}

fn admin_err(
    r: Result<(String, tessera_protocol::AllocationStatus), ClientError>,
) -> AdminErrorKind {
    match r {
        Err(ClientError::Admin { kind, .. }) => kind,
        other => panic!("expected an admin error, got {other:?}"),
    }
}

fn used(admin: &mut AdminClient, id: &str) -> u64 {
    admin
        .list()
        .unwrap()
        .into_iter()
        .find(|a| a.id == id)
        .unwrap()
        .memory_used
}

mod lifecycle;
mod limits;
mod pressure;
mod wire;
