//! `gpu-checkpoint cuda ...`: cuda-checkpoint parity.

#[derive(clap::Subcommand)]
pub enum Command {
    /// Print the CUDA checkpoint state of a process.
    State {
        #[arg(long)]
        pid: i32,
    },
}

pub fn run(_cmd: Command) -> anyhow::Result<()> {
    anyhow::bail!("`cuda` is not built yet")
}
