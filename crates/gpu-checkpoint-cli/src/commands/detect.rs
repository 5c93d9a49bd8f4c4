//! `gpu-checkpoint detect`

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`detect` is not built yet")
}
