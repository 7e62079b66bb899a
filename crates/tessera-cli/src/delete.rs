//! `tessera delete ID [--force]`: delete an allocation by id (an operator's way out of one left
//! behind, e.g. created before allocations had owners).
//!
//! Exit codes: 0 deleted; 1 no such allocation, or refused while processes of it live; 3 the
//! arbiter could not be reached; 4 the arbiter refused (on the user socket: another user's
//! allocation). Refuses while processes of the allocation are connected, unless `--force`: those processes'
//! allocations are refused from then on and their memory stays counted until they exit.

use tessera_protocol::client::AdminClient;

use crate::CliError;

/// Arguments of `tessera delete`.
#[derive(Debug, clap::Args)]
pub(crate) struct DeleteArgs {
    /// The allocation's id (as `tessera status` shows it).
    pub id: String,
    /// Delete even while processes of it are connected.
    #[arg(long)]
    pub force: bool,
    /// The arbiter's admin or user socket (a user deletes only their own allocations).
    #[command(flatten)]
    pub sockets: crate::endpoint::SocketArgs,
}

/// Runs `tessera delete`; returns the exit code.
pub(crate) fn main(args: DeleteArgs) -> Result<u8, CliError> {
    let endpoint = args.sockets.endpoint();
    let sock = &endpoint.path;
    let mut admin = AdminClient::connect(sock).map_err(|e| CliError::arbiter(e, sock))?;
    let list = admin.list().map_err(|e| CliError::arbiter(e, sock))?;
    let Some(a) = list.iter().find(|a| a.id == args.id) else {
        return Err(anyhow::anyhow!("no allocation {}", args.id).into());
    };
    if a.processes > 0 && !args.force {
        return Err(anyhow::anyhow!(
            "allocation {} has {} connected process(es); stop them first, or pass --force",
            a.id,
            a.processes
        )
        .into());
    }
    admin
        .delete(&args.id)
        .map_err(|e| CliError::arbiter(e, sock))?;
    println!("deleted allocation {}", args.id);
    Ok(0)
}
