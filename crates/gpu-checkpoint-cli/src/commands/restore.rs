//! `gpu-checkpoint restore`

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`restore` is not built yet")
}
