//! Allocations that span several GPUs ("GPU groups").
//!
//! A multi-GPU allocation is one slice per GPU (each an ordinary allocation with its own
//! memory limit, share, ledger and scheduler) created together under one token and tied by
//! the label [`LABEL_GPU_GROUP`]. The container is handed only the group token, which is the
//! token of the first slice; the interposer connects for each other GPU with that GPU's
//! [`slice_token`], derived from the group token and the GPU's UUID. Only someone who holds
//! the group token can derive a slice's token (a one-way hash), so a tenant reaches the slices
//! of its own group and nothing else, and a GPU outside the group has no token at all.

use sha2::{Digest, Sha256};

/// Label carried by every slice of a multi-GPU allocation: the group's id (the first slice's
/// public id). Only the admin API sets labels, so a tenant cannot join a group.
pub const LABEL_GPU_GROUP: &str = "tessera.dev/gpu-group";

/// Most GPUs one allocation may span.
pub const MAX_GROUP_GPUS: usize = 16;

/// The token a process presents for GPU `gpu_uuid` of the group whose token is `group_token`:
/// 64 hex digits of SHA-256 over a domain tag, the group token and the UUID (case folded, as
/// UUIDs are compared everywhere). The first slice uses the group token itself, so callers
/// pick [`slice_token`] only for the other GPUs.
pub fn slice_token(group_token: &str, gpu_uuid: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"tessera gpu slice v1\0");
    h.update(group_token.as_bytes());
    h.update([0u8]);
    h.update(gpu_uuid.to_ascii_lowercase().as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_token_depends_on_the_group_token_and_the_gpu_only() {
        let t = "ab".repeat(32);
        let a = slice_token(&t, "GPU-1111");
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(a, slice_token(&t, "gpu-1111"), "UUIDs are case folded");
        assert_ne!(a, slice_token(&t, "GPU-2222"));
        assert_ne!(a, slice_token(&"cd".repeat(32), "GPU-1111"));
        assert_ne!(a, t);
    }
}
