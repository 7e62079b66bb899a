//! The memory ledger: bytes held per allocation and per connection. The rules are the
//! `tessera-ledger` crate's, pure and without a runtime, so the interposer's test arbiter
//! checks its sessions against these very rules and not a copy.

pub(crate) use tessera_ledger::*;
