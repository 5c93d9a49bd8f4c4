//! `gpu-checkpoint guardian` (hidden): the process `checkpoint` and `restore` start before they touch a
//! tree, which finishes or undoes their work should they be killed (`gpu_checkpoint::flows::guardian`).
//! Not for people: it expects its socket at descriptor 3.

use gpu_checkpoint::flows::guardian;

#[derive(clap::Args)]
pub struct Args {
    /// The tool process to watch.
    #[arg(long)]
    tool_pid: i32,
}

pub fn run(args: Args) -> super::Result<()> {
    // A guardian started by hand has no socket at descriptor 3 (or someone else's): refuse.
    let fd = guardian::GUARDIAN_FD;
    // SAFETY: an all-zero sockaddr is a valid value to be filled in.
    let mut addr: libc::sockaddr = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr>() as libc::socklen_t;
    // SAFETY: getsockname with valid out-pointers on a descriptor number; fails harmlessly if not a socket.
    if unsafe { libc::getsockname(fd, &mut addr, &mut len) } != 0
        || addr.sa_family != libc::AF_UNIX as libc::sa_family_t
    {
        return Err(super::usage(
            "`guardian` is started by checkpoint and restore themselves, with its socket at descriptor 3",
        ));
    }
    // SAFETY: descriptor 3 is the UNIX socket Guardian::spawn passed us, owned by nothing else here.
    let sock = unsafe { guardian::inherited_socket() };
    std::process::exit(gpu_checkpoint::flows::node::serve_guardian(
        sock,
        args.tool_pid,
    ));
}
