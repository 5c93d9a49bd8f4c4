//! `gpu-checkpoint inspect`

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`inspect` is not built yet")
}
