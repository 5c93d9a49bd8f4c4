//! `gpu-checkpoint release-network-lock`: releases the network lock a `--tcp-established` checkpoint left
//! on this node for its restore (CRIU's `inet CRIU-<run id>` table or iptables rules, which drop the
//! checkpointed connections' segments until a restore succeeds), when the restore is given up; and the
//! note a failed restore prints while that lock is still there.

use gpu_checkpoint::dump::{KeptNetworkLock, LockState, Released};
use gpu_checkpoint::restore::Target;
use serde_json::json;

use super::list::StoreArgs;
use super::Format;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint id, or name (its newest checkpoint).
    pub checkpoint: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// The command's outcome, as `--format json` names it.
const RELEASED: &str = "released";
const NONE_LEFT: &str = "none-left";
const NONE_RECORDED: &str = "none-recorded";

pub fn run(args: Args) -> super::Result<()> {
    let node = super::node(args.store.open()?)?;
    let (info, manifest) = node.find(&Target::Checkpoint(args.checkpoint.clone()))?;
    let id = info.id;
    let lock = manifest.kept_network_lock;
    let (outcome, text) = match &lock {
        None => (
            NONE_RECORDED,
            format!("nothing to release: checkpoint {id} left no network lock (taken without --tcp-established, with --leave-running, or with --network-lock skip)"),
        ),
        Some(l) => match l.release(&id)? {
            Released::NothingLeft => (
                NONE_LEFT,
                format!("nothing to release: checkpoint {id}'s network lock ({}) is no longer there (a restore took it over, it was released, or its network namespace is gone)", l.describe()),
            ),
            Released::Released => (
                RELEASED,
                format!("released checkpoint {id}'s network lock: {}", l.describe()),
            ),
        },
    };
    if args.store.format == Format::Json {
        return super::print_json(&json!({
            "id": id,
            "outcome": outcome,
            "released": outcome == RELEASED,
            "network_lock": lock,
        }));
    }
    println!("{text}");
    if outcome == RELEASED {
        eprintln!("its connections' segments are no longer dropped on this node: peers outside the checkpoint get resets, and a restore of {id} brings such connections back broken");
    }
    Ok(())
}

/// After a failed restore of checkpoint `id` (in store `storage`; `more`: the restore's other arguments
/// that matter, ` --container ID`): says on stderr that its network lock is still in place on this node,
/// what that means and what to do, if it is.
pub fn say_if_kept(id: &str, lock: Option<&KeptNetworkLock>, storage: &str, more: &str) {
    let Some(lock) = lock else {
        return;
    };
    if !matches!(lock.state(), Ok(LockState::Held)) {
        return;
    }
    eprintln!(
        "gpu-checkpoint: checkpoint {id}'s network lock is still in place on this node: {}. Segments of the \
         connections it checkpointed are dropped here until a restore succeeds (and so are those of a new \
         connection with the same addresses and ports). Restore again (`gpu-checkpoint restore {id} --storage \
         {storage}{more}`), or give the connections up and release the lock (`gpu-checkpoint release-network-lock \
         {id} --storage {storage}`).",
        lock.describe()
    );
}
