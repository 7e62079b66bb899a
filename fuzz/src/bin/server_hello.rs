//! Fuzz target `server_hello`: see `tessera_fuzz::checks` for its input and invariants.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        tessera_fuzz::checks::run_target("server_hello", data);
    });
}
