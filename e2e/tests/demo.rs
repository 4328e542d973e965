//! `bootstrap-demo`: the one command a newcomer runs shows every loop repairing what it broke,
//! and its `--help` is about the demo alone.

use std::process::Command;

use test_support::process::{clean_command, run};

fn demo() -> Command {
    clean_command(env!("CARGO_BIN_EXE_bootstrap-demo"))
}

#[test]
fn demo_exits_0_after_showing_every_repair() {
    let (code, stdout, stderr) = run(&mut demo());
    assert_eq!(code, 0, "{stdout}{stderr}");
    for shown in [
        "kube-public recreated by the controller",
        "label restored",
        "ServiceCIDR kubernetes holds",
        "port 443 restored by the controller",
        "recreated by the controller for default/demo-web",
        "192.0.2.11 removed: its Lease expired",
        "PortAlreadyAllocated on Service demo-np-second",
        "PortOutOfRange on Service demo-np-outside",
        // CI installs etcd, so the demo's etcd mode runs there.
        "PortNotAllocated on Service demo-np-first",
    ] {
        assert!(stdout.contains(shown), "{shown:?} missing:\n{stdout}");
    }
    // Where to look: the events by reason and the repairs per loop from /metrics.
    assert!(stdout.contains("ClusterIPNotAllocated"), "{stdout}");
    assert!(stdout.contains("repairs per loop:"), "{stdout}");
    assert!(stdout.contains("clusterip-repair 1"), "{stdout}");
}

#[test]
fn help_lists_the_demos_flags_only() {
    let (code, stdout, stderr) = run(demo().arg("--help"));
    assert_eq!(code, 0, "{stderr}");
    for flag in ["--config", "--keep-running"] {
        assert!(stdout.contains(flag), "{flag} missing:\n{stdout}");
    }
    for controller_flag in [
        "--kubeconfig",
        "--leader-elect",
        "--etcd-servers",
        "--dry-run",
    ] {
        assert!(
            !stdout.contains(controller_flag),
            "{controller_flag} is the controller's:\n{stdout}"
        );
    }
    let (code, stdout, stderr) = run(demo().args(["--config", "/nonexistent/demo.yaml"]));
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stderr.contains("/nonexistent/demo.yaml"), "{stderr}");
}
