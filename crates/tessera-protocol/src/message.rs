//! Every message on Tessera's two sockets.
//!
//! The tenant socket (mounted into containers) carries [`TenantRequest`]/[`TenantReply`];
//! the admin socket (never mounted into containers) carries [`AdminRequest`]/[`AdminReply`].
//! Both open with [`Hello`] -> [`ServerHello`]. New variants are only ever appended, so
//! postcard's variant indices stay stable within a protocol version.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Who is connecting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// A process running under the interposer, identified by its allocation token.
    /// Its pid is taken from `SO_PEERCRED`, never from the message.
    Tenant {
        /// The allocation token handed out by the admin API.
        token: String,
    },
    /// An admin tool (CLI, device plugin) on the admin socket.
    Admin,
    /// A second connection of a process whose memory connection was admitted (its lease
    /// connection): `ticket` is a one-use `Ticket` answer from that connection. It is tied to
    /// the admitted connection, so it does not meet the admission caps again (at most
    /// [`COMPANIONS_PER_CONNECTION`] per memory connection).
    Companion {
        /// The allocation token (the same as the memory connection's).
        token: String,
        /// A ticket the memory connection was given.
        ticket: u64,
    },
    /// `tessera doctor`'s question "is an arbiter of this version serving here, and which
    /// socket is this?", answered on every socket by [`ServerHello::Probed`] and the connection
    /// closed. It asks nothing else, so it is no failed handshake (and leaves no warning in the
    /// arbiter's log). (Appended.)
    Probe,
}

/// Which of the arbiter's sockets answered a [`Role::Probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SocketKind {
    /// The tenant socket (the interposer's).
    Tenant,
    /// The admin socket (root's).
    Admin,
    /// The user socket (a workstation's users; see `docs/install.md`).
    User,
}

impl std::fmt::Display for SocketKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tenant => "tenant",
            Self::Admin => "admin",
            Self::User => "user",
        })
    }
}

/// Most [`Role::Companion`] connections one admitted memory connection may have open at once
/// (its lease connection, and one more while a broken one is being replaced).
pub const COMPANIONS_PER_CONNECTION: usize = 2;

/// How long a process that read a `Pressure` keeps no memory credit: it asks for none, and
/// gives every free back at once on its pressure channel. The arbiter relies on it: a channel
/// that answered a `Pressure` sent less than this long ago (less a margin) holds no credit
/// worth pressing for again (a churner in its [`TURN`] gives its credit back by itself when
/// the turn ends).
pub const PRESSED_FOR: std::time::Duration = std::time::Duration::from_millis(50);

/// A process's *turn*: for this long after the arbiter granted it a reservation, a process that
/// is pressed keeps the credit its frees make (its next allocations need no round trip) and
/// gives it back when the turn ends, by itself. Eight processes hammering one full allocation
/// then hand their chunks over once a turn rather than at every allocation (issue 36: from half
/// to two thirds of no control's allocation rate to nine tenths). Only a churner gets a turn: a
/// process whose allocation came within microseconds of its last free (the interposer's
/// `CHURN_GAP`); one that hands memory to a sibling gives its frees back at once. The arbiter
/// relies on it: a waiter that pressed a sibling with a channel waits the memory wait from the
/// end of that sibling's possible turn, and a process that is not waiting is given no room a
/// waiter could take (so a turn's end hands the chunk to a waiter, not back to the same process).
pub const TURN: std::time::Duration = std::time::Duration::from_millis(20);

/// First frame of every connection, client to server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Must be [`crate::MAGIC`].
    pub magic: u32,
    /// The client's [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// What the client is.
    pub role: Role,
}

impl Hello {
    /// A hello for this build's version.
    pub fn new(role: Role) -> Self {
        Self {
            magic: crate::MAGIC,
            version: crate::PROTOCOL_VERSION,
            role,
        }
    }
}

/// The server's answer to [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerHello {
    /// Accepted; for tenants, the allocation's limits.
    Welcome {
        /// The server's protocol version.
        version: u32,
        /// The tenant's allocation (`None` for admin connections).
        allocation: Option<AllocationView>,
    },
    /// Refused, in the form every protocol version reads: a server answers it to a client of
    /// another version (so that client can say why), and only then. A client therefore reads
    /// it as [`RefusalKind::Version`]. The server closes the connection after this frame.
    Refused {
        /// Why, for the log and the user.
        reason: String,
    },
    /// Refused, with a kind a caller can decide on (a client of this version). The server
    /// closes the connection after this frame.
    Rejected {
        /// What went wrong, for callers that must decide.
        kind: RefusalKind,
        /// Why, for the log and the user.
        reason: String,
    },
    /// The answer to [`Role::Probe`]; the server closes the connection after this frame.
    /// (Appended.)
    Probed {
        /// The server's protocol version.
        version: u32,
        /// The socket that answered.
        socket: SocketKind,
    },
}

/// Why a handshake was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RefusalKind {
    /// The client speaks another protocol version.
    Version,
    /// The role belongs on the other socket (an admin client on the tenant socket, or a tenant
    /// on the admin socket).
    WrongSocket,
    /// The token names no allocation (a wrong token, or its allocation was deleted).
    UnknownToken,
    /// The companion ticket is unknown, used, or another allocation's.
    BadTicket,
    /// A connection cap is full (the allocation's, the shared pool's, or the process's
    /// companions): the same hello may be admitted later.
    Full,
    /// The peer may not use this socket (the user socket: not in its group, or the kernel
    /// could not name it). (Appended.)
    Forbidden,
}

impl RefusalKind {
    /// A stable lowercase name, for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Version => "version",
            Self::WrongSocket => "wrong_socket",
            Self::UnknownToken => "unknown_token",
            Self::BadTicket => "bad_ticket",
            Self::Full => "full",
            Self::Forbidden => "forbidden",
        }
    }
}

impl std::fmt::Display for RefusalKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ServerHello {
    /// The refusal to send a client of protocol `client_version`: the kind-carrying form to a
    /// client of this version, the form every version reads to any other.
    pub fn refusal(kind: RefusalKind, reason: impl Into<String>, client_version: u32) -> Self {
        let reason = reason.into();
        if client_version == crate::PROTOCOL_VERSION {
            Self::Rejected { kind, reason }
        } else {
            Self::Refused { reason }
        }
    }

    /// The kind and text of a refusal; `None` for a welcome.
    pub fn refused(&self) -> Option<(RefusalKind, &str)> {
        match self {
            Self::Welcome { .. } | Self::Probed { .. } => None,
            // Only ever sent across versions (see the variant).
            Self::Refused { reason } => Some((RefusalKind::Version, reason)),
            Self::Rejected { kind, reason } => Some((*kind, reason)),
        }
    }
}

/// What a tenant learns about its own allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationView {
    /// Public allocation id (not the token).
    pub id: String,
    /// GPU index on the node.
    pub gpu_index: u32,
    /// GPU UUID, `GPU-...`.
    pub gpu_uuid: String,
    /// Bytes the whole allocation may hold at once.
    pub memory_limit: u64,
    /// Compute weight, 1..=100.
    pub share: u32,
    /// Hard ceiling on the fraction of GPU time, percent, if any.
    pub cap: Option<u32>,
}

/// Requests on the tenant socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TenantRequest {
    /// Reserve `bytes` before an allocation; answered by `Reserved` or `Denied`.
    /// Reservation is atomic across all processes of the allocation.
    Reserve {
        /// Bytes to reserve.
        bytes: u64,
    },
    /// Return `bytes` after a free (or a failed driver allocation). One-way: no reply, so a
    /// free costs no round trip; frames on one connection are handled in order.
    Release {
        /// Bytes to release.
        bytes: u64,
    },
    /// After a reconnect: the process declares what it already holds. Always accepted (the
    /// memory is live); answered by `Reserved`.
    Redeclare {
        /// Bytes this process holds.
        bytes: u64,
    },
    /// Ask for the allocation's limit and use; answered by `MemInfo`. What interposers before
    /// [`TenantRequest::MemInfoAfter`] send; answered as if it had given nothing back.
    MemInfo,
    /// Liveness check; answered by `Pong`.
    Ping,
    /// Compute sharing: ask for a time-slice lease on the allocation's GPU; answered by
    /// `LeaseGranted` once the arbiter grants it (the reply may wait).
    LeaseAcquire,
    /// Compute sharing: the lease is over (or handed back early); reports the GPU time the
    /// process's work really used during it, overrun included. One-way.
    LeaseRelease {
        /// Lease being returned.
        lease_id: u64,
        /// Measured GPU busy time charged to this lease, ns.
        busy_ns: u64,
        /// True when handed back before its deadline because the queue drained.
        early: bool,
    },
    /// Reserve `bytes` (all or nothing) plus up to `extra` bytes of *credit*: memory the
    /// process may then allocate and free locally, without a round trip. The extra is granted
    /// only from room nobody else needs. Answered by `Granted` or `Denied`. Before refusing,
    /// the arbiter takes unused credit back from the allocation's other processes.
    ReserveCredit {
        /// Bytes that must be reserved.
        bytes: u64,
        /// Credit wanted on top, best effort.
        extra: u64,
        /// `Relinquish` frames this process has sent on its pressure channel so far: before
        /// refusing, the arbiter lets the channel catch up to them (frees sent there must
        /// count, though they travel on another socket).
        given_back: u64,
    },
    /// Ask for a one-use ticket that ties a second connection of this process to this one as
    /// its pressure channel; answered by `Ticket`.
    Ticket,
    /// On a second connection: become the pressure channel of the connection that was given
    /// `ticket`. Answered by `Subscribed`; afterwards the arbiter sends `Pressure` frames here.
    Subscribe {
        /// The ticket from `Ticket`.
        ticket: u64,
    },
    /// On a pressure channel: the answer to `Pressure { seq }`: the process gave back `bytes`
    /// of unused credit (the release is booked on the connection it is the channel of).
    /// One-way.
    Relinquish {
        /// The pressure being answered.
        seq: u64,
        /// Bytes released.
        bytes: u64,
    },
    /// Ask for the allocation's limit and use once the arbiter has handled the `given_back`
    /// `Relinquish` frames this process sent on its pressure channel (the bytes it just freed
    /// are not in use, though they travel on another socket); answered by `MemInfo`.
    MemInfoAfter {
        /// `Relinquish` frames this process has sent on its pressure channel so far.
        given_back: u64,
    },
    /// As `LeaseAcquire`, from an interposer that reads `LeaseGrantedLatency`: a latency
    /// allocation's grants to this connection come as that. `LeaseAcquire` is what interposers
    /// before it send; they are granted `LeaseGranted` whatever the tier.
    LeaseAcquireTiered,
}

/// Replies on the tenant socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TenantReply {
    /// Reservation (or redeclaration) accepted.
    Reserved {
        /// Allocation-wide bytes in use after it.
        in_use: u64,
    },
    /// Reservation refused: it would pass the limit.
    Denied {
        /// The allocation's limit.
        limit: u64,
        /// Allocation-wide bytes in use.
        in_use: u64,
    },
    /// Answer to `MemInfo`.
    MemInfo {
        /// The allocation's limit.
        limit: u64,
        /// Allocation-wide bytes in use.
        in_use: u64,
    },
    /// Answer to `Ping`.
    Pong,
    /// A lease: the holder may launch work until `duration_ns` after it received this.
    LeaseGranted {
        /// Lease id, echoed in `LeaseRelease`.
        lease_id: u64,
        /// Lease length, ns.
        duration_ns: u64,
    },
    /// The request could not be served.
    Error {
        /// Why.
        message: String,
    },
    /// Answer to `ReserveCredit`: `bytes` reserved in all (the request plus the credit given).
    Granted {
        /// Bytes reserved for this process by this request.
        bytes: u64,
        /// Allocation-wide bytes reserved after it.
        in_use: u64,
    },
    /// Answer to `Ticket`.
    Ticket {
        /// One-use ticket for `Subscribe`.
        ticket: u64,
    },
    /// Answer to `Subscribe`.
    Subscribed,
    /// Sent unasked on a pressure channel: another process of the allocation would be refused;
    /// give back all unused credit now, answering with `Relinquish { seq, .. }`.
    Pressure {
        /// Echoed in `Relinquish`.
        seq: u64,
    },
    /// A lease for a best-effort holder while a latency tenant is on the GPU: as
    /// `LeaseGranted`, and the holder keeps at most `max_inflight_ns` of predicted kernel time
    /// in flight. (Appended: `LeaseGranted` keeps its encoding.)
    LeaseGrantedBounded {
        /// Lease id, echoed in `LeaseRelease`.
        lease_id: u64,
        /// Lease length, ns.
        duration_ns: u64,
        /// Most predicted kernel time in flight, ns.
        max_inflight_ns: u64,
    },
    /// Sent unasked on the lease connection: the lease is over now (a latency tenant asked);
    /// launch nothing more under it, and ask again for the next one.
    LeaseRevoked {
        /// The lease taken back.
        lease_id: u64,
    },
    /// A lease for a latency holder that asked with `LeaseAcquireTiered`: as `LeaseGranted`, and
    /// the holder hands it back as soon as its work has drained, without learning from requests
    /// that follow a hand-back (a latency service's next request comes when its client sends
    /// it: keeping the GPU idle for it costs best-effort work its share of the rest; the
    /// arbiter's linger is the knob that keeps the GPU for one). (Appended: the earlier replies
    /// keep their encodings.)
    LeaseGrantedLatency {
        /// Lease id, echoed in `LeaseRelease`.
        lease_id: u64,
        /// Lease length, ns.
        duration_ns: u64,
    },
}

/// Which GPU an allocation lives on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuSelector {
    /// Node-wide GPU index (NVML order).
    Index(u32),
    /// GPU UUID, `GPU-...`.
    Uuid(String),
}

/// `GPU 0` or `GPU GPU-8f0c...`: as people name a GPU in logs and refusals.
impl std::fmt::Display for GpuSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuSelector::Index(i) => write!(f, "GPU {i}"),
            GpuSelector::Uuid(u) => write!(f, "GPU {u}"),
        }
    }
}

/// A new allocation's parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateAllocation {
    /// The GPU.
    pub gpu: GpuSelector,
    /// Memory limit in bytes (at most the GPU's memory).
    pub memory_limit: u64,
    /// Compute weight, 1..=100.
    pub share: u32,
    /// Hard ceiling on the fraction of GPU time, percent 1..=100.
    pub cap: Option<u32>,
    /// Free-form labels kept with the allocation (the device plugin stores its unit ids here).
    pub labels: BTreeMap<String, String>,
}

/// Requests on the admin socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdminRequest {
    /// List the node's GPUs; answered by `Gpus`.
    ListGpus,
    /// Create an allocation; answered by `Created`.
    Create(CreateAllocation),
    /// List allocations with their use; answered by `Allocations`.
    List,
    /// Delete an allocation by id; answered by `Deleted`.
    Delete {
        /// The allocation's public id.
        id: String,
    },
    /// Merges labels into an allocation's labels (an empty value removes the key); answered by
    /// `Updated`. The device plugin names the pod this way once PodResources tells it.
    UpdateLabels {
        /// The allocation's public id.
        id: String,
        /// Keys to set; a key with an empty value is removed.
        labels: BTreeMap<String, String>,
    },
    /// Create an allocation owned by a process (`tessera run`); answered by `Created`. The
    /// backstop attributes every descendant of the owner to it, and the arbiter deletes it once
    /// the owner is gone and none of its processes is left. (Appended so that `Create` keeps
    /// its encoding.)
    CreateOwned {
        /// The allocation.
        create: CreateAllocation,
        /// The process that owns it.
        owner: ProcessOwner,
    },
    /// Create an allocation in a service tier, owned by a process or not; answered by
    /// `Created`. Only the admin socket takes it: a tenant never picks its tier. (Appended so
    /// that `Create` and `CreateOwned` keep their encodings; they create best-effort ones.)
    CreateTiered {
        /// The allocation.
        create: CreateAllocation,
        /// The process that owns it, if any (as `CreateOwned`).
        owner: Option<ProcessOwner>,
        /// Its tier.
        tier: crate::Tier,
    },
    /// Create one allocation spanning several GPUs: one slice per entry (distinct GPUs, each
    /// with its own limit, share and cap), all or none, under one token (see
    /// [`crate::group`]); answered by `CreatedGroup`. (Appended.)
    CreateGroup {
        /// One slice per GPU; the first one's token is the group's.
        slices: Vec<CreateAllocation>,
        /// The process that owns every slice (`tessera run`), if any.
        owner: Option<ProcessOwner>,
    },
    /// The last process of an allocation the backstop killed, and why; answered by
    /// `LastKill` (`None`: it killed none). `tessera run` asks it when its command ends, to
    /// say why it was stopped. (Appended.)
    LastKill {
        /// The allocation's public id.
        id: String,
    },
}

/// A process of an allocation the backstop killed, as the arbiter recorded it when it did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KillRecord {
    /// The process (host pid).
    pub pid: i32,
    /// Why, for people: `held 5.29 GiB on GPU 0, allowed 4.06 GiB ...`.
    pub reason: String,
    /// When, seconds since the Unix epoch.
    pub unix: u64,
}

/// A process named so that its pid cannot be reused behind its back: the pid and its start
/// time (field 22 of `/proc/<pid>/stat`, clock ticks since boot). A process with that pid and
/// another start time is someone else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProcessOwner {
    /// Host pid.
    pub pid: i32,
    /// Its start time, clock ticks after boot.
    pub start_time: u64,
}

/// Allocation label naming the pod's namespace (written by the device plugin from
/// PodResources; exported as the metric label `namespace`).
pub const LABEL_NAMESPACE: &str = "tessera.dev/namespace";
/// Allocation label naming the pod (metric label `pod`).
pub const LABEL_POD: &str = "tessera.dev/pod";
/// Allocation label naming the container (metric label `container`).
pub const LABEL_CONTAINER: &str = "tessera.dev/container";
/// Allocation label set at creation on the whole-GPU allocations the device plugin makes for
/// one container (all carry the same value): the container's processes, attributed to the first
/// of them by its identity file, may use all their cards, and the backstop polices them on the
/// others. Only the admin API sets labels, so a tenant cannot join a group.
pub const LABEL_WHOLE_GROUP: &str = "tessera.dev/whole-group";

/// Allocation label naming the DRA claim it serves, `namespace/name` (written by the DRA
/// plugin; `tessera status` shows it).
pub const LABEL_CLAIM: &str = "tessera.dev/claim";

/// Most labels one allocation keeps, and the longest key and value (bytes). Labels travel in
/// every admin `List` reply and become metric labels, so they stay small.
pub const MAX_LABELS: usize = 32;
/// Longest label key, bytes (a Kubernetes qualified name is at most 253 + 1 + 63).
pub const MAX_LABEL_KEY: usize = 317;
/// Longest label value, bytes.
pub const MAX_LABEL_VALUE: usize = 1024;

/// One GPU of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index.
    pub index: u32,
    /// UUID, `GPU-...`.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Total memory, bytes.
    pub memory_total: u64,
}

/// An allocation as the admin API reports it. `Default` is for tests and fakes that fill in
/// a few fields.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationStatus {
    /// Public id.
    pub id: String,
    /// GPU index.
    pub gpu_index: u32,
    /// GPU UUID.
    pub gpu_uuid: String,
    /// Memory limit, bytes.
    pub memory_limit: u64,
    /// Bytes in use across all its processes.
    pub memory_used: u64,
    /// Connected processes.
    pub processes: u32,
    /// Compute weight.
    pub share: u32,
    /// Compute cap, percent.
    pub cap: Option<u32>,
    /// GPU time used over the last 10 s, ns.
    pub gpu_time_10s_ns: u64,
    /// Labels given at creation.
    pub labels: BTreeMap<String, String>,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix: u64,
    /// Processes of this allocation the memory backstop acted on (killed or reported) since the
    /// arbiter started.
    pub enforced: u64,
    /// GPU time charged to it since the arbiter started, ns: its leases (each the longer of
    /// the time held and the busy time reported) and time used outside leases.
    pub gpu_time_total_ns: u64,
    /// Time its processes spent waiting for a lease since the arbiter started, ns (summed over
    /// processes).
    pub throttled_total_ns: u64,
    /// Reservations refused at its memory limit (each one an out-of-memory error in a tenant).
    pub oom_refusals: u64,
    /// Compute leases granted to its processes.
    pub leases: u64,
    /// The process that owns it (`tessera run`), if one does.
    pub owner: Option<ProcessOwner>,
    /// Its owner is gone; it is deleted once none of its processes is left.
    pub orphaned: bool,
    /// Its service tier (set at creation by the operator).
    pub tier: crate::Tier,
    /// The uid that created it, as the kernel named the admin or user socket's peer (`None`:
    /// created before owners were recorded). A user may delete only their own allocations.
    pub owner_uid: Option<u32>,
}

/// Classes of admin errors, so tools can map them to exit codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdminErrorKind {
    /// Bad parameters (unknown GPU, limit above the card, share out of range).
    InvalidArgument,
    /// No such allocation.
    NotFound,
    /// The GPU cannot take it (e.g. shares or memory already promised).
    Exhausted,
    /// The arbiter failed (e.g. could not persist).
    Internal,
    /// The caller may not do this: another user's allocation, a quota passed, or a request
    /// the user socket does not take. (Appended.)
    PermissionDenied,
}

/// Replies on the admin socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdminReply {
    /// Answer to `ListGpus`.
    Gpus(Vec<GpuInfo>),
    /// Answer to `Create`: the secret token for tenants, and the allocation.
    Created {
        /// Secret handed to the tenant (at least 128 random bits, hex).
        token: String,
        /// The new allocation.
        allocation: AllocationStatus,
    },
    /// Answer to `List`.
    Allocations(Vec<AllocationStatus>),
    /// Answer to `Delete`.
    Deleted,
    /// The request failed.
    Error {
        /// Class of failure.
        kind: AdminErrorKind,
        /// Human-readable reason.
        message: String,
    },
    /// Answer to `UpdateLabels`: the allocation with its new labels.
    Updated(AllocationStatus),
    /// Answer to `CreateGroup`: the group token (the first slice's) and the slices, in the
    /// order asked.
    CreatedGroup {
        /// Secret handed to the tenant.
        token: String,
        /// One allocation per GPU.
        allocations: Vec<AllocationStatus>,
    },
    /// Answer to `LastKill`. (Appended.)
    LastKill(Option<KillRecord>),
}
