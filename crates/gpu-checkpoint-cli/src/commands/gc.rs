//! `gpu-checkpoint gc`

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`gc` is not built yet")
}
