//! `gpu-checkpoint doctor`

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`doctor` is not built yet")
}
