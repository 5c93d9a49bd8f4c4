//! Tests of the CRIU options: parsing, the configuration file, the RPC request, restore checks.

use super::*;
use strum::VariantArray;

#[test]
fn sizes_parse_like_criu() {
    assert_eq!(parse_size("1M"), Ok(1 << 20));
    assert_eq!(parse_size("512K"), Ok(512 << 10));
    assert_eq!(parse_size("512k"), Ok(512 << 10));
    assert_eq!(parse_size("4MiB"), Ok(4 << 20));
    assert_eq!(parse_size("2MB"), Ok(2 << 20));
    assert_eq!(parse_size("1G"), Ok(1 << 30));
    assert_eq!(parse_size("1048576"), Ok(1 << 20));
    assert_eq!(parse_size("4294967295"), Ok(u32::MAX));
    for bad in ["", "M", "4X", "4G", "-1", "1.5M", "99999999999999999999"] {
        assert!(parse_size(bad).is_err(), "{bad} accepted");
    }
    assert_eq!(format_size(2 << 20), "2M");
    assert_eq!(format_size(1536 << 10), "1536K");
    assert_eq!(format_size(1000), "1000");
    assert_eq!(format_size(3 << 30), "3G");
}

#[test]
fn modes_are_criu_names() {
    for m in CgroupMode::VARIANTS {
        assert_eq!(m.to_string().parse::<CgroupMode>(), Ok(*m));
        assert_eq!(serde_json::to_value(m).unwrap(), m.to_string());
    }
    assert_eq!("soft".parse::<CgroupMode>(), Ok(CgroupMode::Soft));
    assert_eq!("nftables".parse::<NetworkLock>(), Ok(NetworkLock::Nftables));
    assert!("bogus".parse::<NetworkLock>().is_err());
}

fn every_option() -> CriuOptions {
    CriuOptions {
        tcp_established: true,
        shell_job: true,
        file_locks: true,
        ghost_limit: Some(4 << 20),
        ext_unix_sk: true,
        external: vec!["mnt[/data]:data".into(), "unix[42]".into()],
        skip_in_flight: true,
        link_remap: true,
        manage_cgroups: Some(CgroupMode::Full),
        network_lock: Some(NetworkLock::Skip),
        tcp_close: true,
        skip_mnt: vec!["/proc/sys".into()],
        enable_external_masters: true,
        config_file: Some("/etc/criu/x.conf".into()),
    }
}

/// Every option reaches CRIU's RPC, and the command line (streamed dumps) says the same.
#[test]
fn every_option_reaches_the_rpc_and_the_command_line() {
    let o = every_option();
    let mut r = rpc::Criu_opts::new();
    o.apply_rpc(&mut r);
    assert!(r.tcp_established() && r.shell_job() && r.file_locks() && r.ext_unix_sk());
    assert_eq!(r.ghost_limit(), 4 << 20);
    assert_eq!(r.external, o.external);
    assert!(r.tcp_skip_in_flight() && r.link_remap() && r.tcp_close() && r.ext_masters());
    assert_eq!(r.manage_cgroups_mode(), rpc::Criu_cg_mode::FULL);
    assert!(r.manage_cgroups());
    assert_eq!(r.network_lock(), rpc::Criu_network_lock_method::SKIP);
    assert_eq!(r.skip_mnt, o.skip_mnt);
    assert_eq!(r.config_file(), "/etc/criu/x.conf");

    let args = o.cli_args().join(" ");
    for want in [
        "--shell-job",
        "--tcp-established",
        "--file-locks",
        "--ext-unix-sk",
        "--skip-in-flight",
        "--link-remap",
        "--tcp-close",
        "--enable-external-masters",
        "--network-lock skip",
        "--ghost-limit 4194304",
        "--external mnt[/data]:data",
        "--external unix[42]",
        "--manage-cgroups=full",
        "--skip-mnt /proc/sys",
        "--config /etc/criu/x.conf",
    ] {
        assert!(args.contains(want), "{want} missing from {args}");
    }

    // Nothing asked, nothing passed (CRIU's own defaults hold), but the shell-job answer.
    let mut r = rpc::Criu_opts::new();
    CriuOptions::default().apply_rpc(&mut r);
    assert!(!r.has_ghost_limit() && !r.has_file_locks() && !r.has_network_lock());
    assert!(!r.has_manage_cgroups_mode() && !r.has_config_file());
    assert!(CriuOptions::default().cli_args().is_empty());
}

#[test]
fn established_connections_get_the_default_network_lock() {
    let o = CriuOptions {
        tcp_established: true,
        ..CriuOptions::default()
    };
    let mut r = rpc::Criu_opts::new();
    o.apply_rpc(&mut r);
    assert!(r.has_network_lock());
    assert!(o.cli_args().contains(&"--network-lock".to_string()));
    // Unless the configuration file names one: ours would override it.
    let conf = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(conf.path(), "network-lock skip\n").unwrap();
    let o = CriuOptions {
        config_file: Some(conf.path().to_path_buf()),
        ..o
    };
    assert_eq!(o.config_file_network_lock(), Some(NetworkLock::Skip));
    let mut r = rpc::Criu_opts::new();
    o.apply_rpc(&mut r);
    assert!(!r.has_network_lock());
    assert!(!o.cli_args().contains(&"--network-lock".to_string()));
}

#[test]
fn needs_are_provided_by_their_flags() {
    let none = CriuOptions::default();
    let two_mib = NeededOption::GhostLimit { bytes: 2 << 20 };
    let small = NeededOption::GhostLimit { bytes: 1 << 20 };
    assert!(none.provides(&small), "CRIU's default limit takes 1 MiB");
    assert!(!none.provides(&two_mib));
    assert!(!none.provides(&NeededOption::FileLocks));
    assert!(!none.provides(&NeededOption::TcpEstablished));
    let o = CriuOptions {
        ghost_limit: Some(2 << 20),
        file_locks: true,
        tcp_close: true,
        external: vec!["unix[7]".into()],
        ..CriuOptions::default()
    };
    assert!(o.provides(&two_mib) && o.provides(&NeededOption::FileLocks));
    assert!(o.provides(&NeededOption::TcpEstablished));
    assert!(o.provides(&NeededOption::ExtUnixSk { inode: 7 }));
    assert!(!o.provides(&NeededOption::ExtUnixSk { inode: 8 }));
    assert!(o.provides(&NeededOption::External {
        resource: "unix[7]".into()
    }));
    assert!(!o.provides(&NeededOption::GhostLimit { bytes: 3 << 20 }));
}

/// An option CRIU gets from a configuration file counts as given.
#[test]
fn configuration_files_add_what_they_name() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("criu.conf");
    std::fs::write(
        &conf,
        "# comment\nfile-locks\n--ghost-limit 8M\n  external unix[7]  # ours\n\
         tcp-established\nlog-file x.log\nmanage-cgroups=soft\n",
    )
    .unwrap();
    let o = CriuOptions {
        config_file: Some(conf),
        ..CriuOptions::default()
    };
    assert!(!o.provides(&NeededOption::FileLocks));
    let e = o.with_config_files();
    assert!(e.provides(&NeededOption::FileLocks));
    assert!(e.provides(&NeededOption::GhostLimit { bytes: 8 << 20 }));
    assert!(e.provides(&NeededOption::ExtUnixSk { inode: 7 }));
    assert!(e.tcp_established && !e.tcp_close);
    assert_eq!(e.config_file, o.config_file);
}

#[test]
fn restore_takes_the_checkpoints_options_and_its_own() {
    let recorded = every_option();
    let out = recorded
        .restore_options(&CriuOptions {
            external: vec!["mnt[data]:/srv/data".into()],
            config_file: Some("/etc/criu/restore.conf".into()),
            ..CriuOptions::default()
        })
        .unwrap();
    let o = out.options;
    assert!(o.tcp_established && o.shell_job && o.file_locks && o.ext_unix_sk && o.tcp_close);
    assert_eq!(o.network_lock, Some(NetworkLock::Skip));
    assert_eq!(o.manage_cgroups, Some(CgroupMode::Full));
    // The restore's own external resources and configuration, not the dump's.
    assert_eq!(o.external, ["mnt[data]:/srv/data"]);
    assert_eq!(o.config_file, Some("/etc/criu/restore.conf".into()));
    // Dump-only options stay with the dump.
    assert!(o.ghost_limit.is_none() && !o.skip_in_flight && !o.link_remap);
    assert!(o.skip_mnt.is_empty() && !o.enable_external_masters);
    assert!(out.decided.is_empty() && out.notes.is_empty());

    // No configuration file given again: a note, not an error.
    let out = recorded.restore_options(&CriuOptions::default()).unwrap();
    assert!(out.notes[0].contains("/etc/criu/x.conf"), "{:?}", out.notes);
}

#[test]
fn restore_flags_the_checkpoint_decides_are_accepted_or_refused() {
    let recorded = CriuOptions {
        tcp_established: true,
        ghost_limit: Some(4 << 20),
        network_lock: Some(NetworkLock::Nftables),
        ..CriuOptions::default()
    };
    // The same as the checkpoint's: accepted, and listed.
    let out = recorded
        .restore_options(&CriuOptions {
            tcp_established: true,
            ghost_limit: Some(4 << 20),
            network_lock: Some(NetworkLock::Nftables),
            ..CriuOptions::default()
        })
        .unwrap();
    assert_eq!(
        out.decided,
        [
            "--tcp-established",
            "--ghost-limit 4M",
            "--network-lock nftables"
        ]
    );
    assert!(out.options.tcp_established);
    // Asking for what the checkpoint was taken without, or with another value: refused, named.
    let refused: [(CriuOptions, &[&str]); 3] = [
        (
            CriuOptions {
                file_locks: true,
                ..CriuOptions::default()
            },
            &["--file-locks", "without"],
        ),
        (
            CriuOptions {
                ghost_limit: Some(8 << 20),
                ..CriuOptions::default()
            },
            &["--ghost-limit 8M", "with --ghost-limit 4M"],
        ),
        (
            CriuOptions {
                network_lock: Some(NetworkLock::Iptables),
                ..CriuOptions::default()
            },
            &["--network-lock iptables"],
        ),
    ];
    for (asked, named) in refused {
        let err = recorded.restore_options(&asked).unwrap_err();
        assert!(named.iter().all(|n| err.contains(n)), "{err}");
    }
    // Without a recorded method, the images hold the default of the checkpoint's time: a note.
    let out = CriuOptions::default()
        .restore_options(&CriuOptions {
            network_lock: Some(NetworkLock::Iptables),
            ..CriuOptions::default()
        })
        .unwrap();
    assert!(
        out.decided.is_empty() && out.notes[0].contains("changes nothing"),
        "{out:?}"
    );
    // Restore-time choices: connections restored closed, another cgroup mode.
    let out = recorded
        .restore_options(&CriuOptions {
            tcp_close: true,
            manage_cgroups: Some(CgroupMode::Ignore),
            ..CriuOptions::default()
        })
        .unwrap();
    assert!(out.options.tcp_close && out.decided.is_empty());
    assert_eq!(out.options.manage_cgroups, Some(CgroupMode::Ignore));
    // Old manifests (only the first three options recorded) read as "nothing else given".
    let old: CriuOptions =
        serde_json::from_str(r#"{"tcp_established": true, "shell_job": false}"#).unwrap();
    assert_eq!(
        old,
        CriuOptions {
            tcp_established: true,
            ..CriuOptions::default()
        }
    );
}
