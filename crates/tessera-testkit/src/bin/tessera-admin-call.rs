//! `tessera-admin-call SOCKET (update-labels ID KEY=VALUE | last-kill ID | delete ID | list)`:
//! one admin request from a process of its own, so a test can make it as another uid (the
//! user socket names its caller by `SO_PEERCRED`). Prints `ok <reply>` and exits 0, or prints
//! `error <kind>: <message>` and exits 1; exit 2 on bad arguments.

use std::path::Path;

use tessera_protocol::client::{AdminClient, ClientError};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(socket), Some(op)) = (args.first(), args.get(1)) else {
        eprintln!("usage: tessera-admin-call SOCKET OP [ARGS]");
        std::process::exit(2);
    };
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let result = AdminClient::connect(Path::new(socket)).and_then(|mut c| match op.as_str() {
        "update-labels" => {
            let kv = arg(3);
            let (k, v) = kv.split_once('=').unwrap_or((&kv, ""));
            let labels = [(k.to_owned(), v.to_owned())].into_iter().collect();
            c.update_labels(&arg(2), labels).map(|a| format!("{a:?}"))
        }
        "last-kill" => c.last_kill(&arg(2)).map(|k| format!("{k:?}")),
        "delete" => c.delete(&arg(2)).map(|()| "deleted".to_owned()),
        "list" => c.list().map(|l| format!("{l:?}")),
        other => {
            eprintln!("unknown op {other}");
            std::process::exit(2);
        }
    });
    match result {
        Ok(text) => println!("ok {text}"),
        Err(ClientError::Admin { kind, message }) => {
            println!("error {kind:?}: {message}");
            std::process::exit(1);
        }
        Err(e) => {
            println!("error other: {e}");
            std::process::exit(1);
        }
    }
}
