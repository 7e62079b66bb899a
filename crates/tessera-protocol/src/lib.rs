//! The wire protocol between Tessera's interposer, arbiter and admin tools.
//!
//! Modules:
//! - [`frame`]: length-prefixed frames with a size limit, blocking I/O and an incremental
//!   decoder for partial input (used by the async arbiter).
//! - [`message`]: every message, for both sockets, and the version handshake.
//! - [`group`]: allocations spanning several GPUs: the group label and each GPU's slice
//!   token, derived from the group token.
//! - [`identity`]: the read-only file the device plugin mounts into each container, naming
//!   its allocation (trusted by the interposer and the backstop).
//! - [`process`]: a process named by pid and start time (allocation owners).
//! - [`client`]: small blocking clients (tenant and admin) over a Unix socket; the interposer
//!   has no async runtime, and the CLI and device plugin reuse the admin one.
//! - [`node`]: the node contract: environment variable names, default paths, and how a process
//!   finds its allocation ([`node::resolve`]), for the interposer and `doctor` alike.
//! - [`size`]: the one size parser (`4GiB`, `1.5G`, `512MiB`) and formatter (`80 GiB`) of every
//!   command and message.
//! - [`tier`]: an allocation's service tier (latency or best-effort), set by the operator.
//!
//! A connection opens with a [`message::Hello`] from the client, answered by
//! [`message::Welcome`] or an error; every later frame is one request or one reply.
//! Encoding is `postcard` (stable, documented wire format).

#![forbid(unsafe_code)]

pub mod client;
pub mod frame;
pub mod group;
pub mod identity;
pub mod message;
pub mod node;
pub mod process;
pub mod size;
pub mod tier;

pub use frame::{FrameDecoder, FrameError, MAX_FRAME_LEN};
pub use message::*;
pub use tier::Tier;

/// Protocol version spoken by this build. Peers of another version are refused, in the one
/// form of [`ServerHello`] that every version reads ([`ServerHello::Refused`]).
///
/// Version 2: refusals carry a [`RefusalKind`] ([`ServerHello::Rejected`]).
pub const PROTOCOL_VERSION: u32 = 2;

/// First bytes of every `Hello`, so a stray client on the socket is told apart from a peer.
pub const MAGIC: u32 = 0x5445_5353; // "TESS"
