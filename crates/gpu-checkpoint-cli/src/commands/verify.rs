//! `gpu-checkpoint verify`

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`verify` is not built yet")
}
