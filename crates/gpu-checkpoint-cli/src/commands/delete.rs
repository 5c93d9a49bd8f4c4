//! `gpu-checkpoint delete`

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`delete` is not built yet")
}
