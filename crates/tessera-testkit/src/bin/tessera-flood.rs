//! `tessera-flood SOCKET CONNECTIONS SECONDS [PAUSE_MS]`: a flood of unauthenticated connections
//! from a process of its own, as a hostile tenant's would be (the admission and flood tests start
//! it through `tessera_testkit::flood::spawn_child`). Exit 2 on bad arguments.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = tessera_testkit::flood::child_main(&args) {
        eprintln!("tessera-flood: {e}");
        std::process::exit(2);
    }
}
