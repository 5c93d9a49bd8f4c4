//! `gpu-checkpoint checkpoint`

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`checkpoint` is not built yet")
}
