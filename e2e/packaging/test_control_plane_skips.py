"""What e2e/control-plane/test.sh reports after the suite ran against a real control plane: the
tests it skipped and why and the test files that ran nothing against the cluster (skips.sh), and
its verdict against expected-skips.txt. The functions run on stand-in records and cargo output;
test.sh itself runs, copied beside stand-ins for up.sh, down.sh, cargo and the test files, with
the record the stand-in cargo writes where BOOTSTRAP_E2E_SKIP_LOG says; expected-skips.txt is
checked against the test files it names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from harness import ROOT

CONTROL_PLANE = ROOT / "e2e" / "control-plane"
SKIPS = CONTROL_PLANE / "skips.sh"
EXPECTED = CONTROL_PLANE / "expected-skips.txt"

RECORD = """\
CLUSTER alpha::one: runs against the given cluster
SKIPPED alpha::two: the whole test: needs the simulator
CLUSTER alpha::two: runs against the given cluster
SKIPPED gamma::four: starts control planes of its own
"""
OUTPUT = """\
   Compiling e2e v0.1.0 (/src/e2e)
     Running tests/alpha.rs (target/debug/deps/alpha-0123456789abcdef)
test one ... ok
     Running tests/gamma.rs (/abs/target/debug/deps/gamma-0123456789abcdef)
SKIPPED gamma::four: starts control planes of its own
     Running unittests src/lib.rs (target/debug/deps/e2e-0123456789abcdef)
"""
# What alpha alone records and prints: test.sh runs the files that run against a given cluster
# (gamma is listed as NOCLUSTER).
RECORD_ALPHA = "".join(line + "\n" for line in RECORD.splitlines() if "gamma" not in line)
OUTPUT_ALPHA = "".join(line + "\n" for line in OUTPUT.splitlines()[:3])
EXPECTED_TEXT = """\
# a comment

SKIPPED alpha::two: the whole test: needs the simulator
SKIPPED gamma::four: starts control planes of its own
NOCLUSTER gamma
unless-root SKIPPED alpha::three: needs root
without-ipaddress-api SKIPPED alpha::one: the whole test: needs networking.k8s.io/v1 ipaddresses
without-audit-log SKIPPED gamma::five: the whole test: needs the audit log
"""


def report(tmp: Path, record: str, output: str, expected: str, root: str, *conditions: str):
    (tmp / "record").write_text(record)
    (tmp / "output").write_text(output)
    (tmp / "expected").write_text(expected)
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; . "{SKIPS}"; skips_report "$@"', "skips",
         str(tmp / "record"), str(tmp / "output"), str(tmp / "expected"), root,
         " ".join(conditions)],
        capture_output=True, text=True, timeout=60)


def test_the_list_as_expected_passes_and_is_printed(tmp_path: Path):
    done = report(tmp_path, RECORD, OUTPUT, EXPECTED_TEXT, "true")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "  SKIPPED alpha::two: the whole test: needs the simulator\n" in done.stdout
    assert "  SKIPPED gamma::four: starts control planes of its own\n" in done.stdout
    # alpha ran against the cluster; gamma did not; the lib's unit tests are no test file.
    assert "  NOCLUSTER gamma\n" in done.stdout
    assert "NOCLUSTER alpha" not in done.stdout and "NOCLUSTER e2e" not in done.stdout
    assert "as " in done.stdout.splitlines()[-1]


def test_a_new_skip_fails_and_is_named(tmp_path: Path):
    record = RECORD + "SKIPPED alpha::one: cannot bind-mount a private /etc/hosts\n"
    done = report(tmp_path, record, OUTPUT, EXPECTED_TEXT, "true")
    assert done.returncode == 1, done.stdout
    assert "  + SKIPPED alpha::one: cannot bind-mount a private /etc/hosts" in done.stdout


def test_a_skip_that_stopped_fails_and_is_named(tmp_path: Path):
    record = RECORD.replace("SKIPPED alpha::two: the whole test: needs the simulator\n", "")
    done = report(tmp_path, record, OUTPUT, EXPECTED_TEXT, "true")
    assert done.returncode == 1, done.stdout
    assert "  - SKIPPED alpha::two: the whole test: needs the simulator" in done.stdout


def test_a_changed_reason_fails(tmp_path: Path):
    record = RECORD.replace("needs the simulator", "needs the simulator's request log")
    done = report(tmp_path, record, OUTPUT, EXPECTED_TEXT, "true")
    assert done.returncode == 1, done.stdout


def test_a_test_file_that_stopped_running_against_the_cluster_fails(tmp_path: Path):
    record = "".join(line + "\n" for line in RECORD.splitlines() if "alpha::one" not in line
                     and not line.startswith("CLUSTER alpha::two"))
    done = report(tmp_path, record, OUTPUT, EXPECTED_TEXT, "true")
    assert done.returncode == 1, done.stdout
    assert "  + NOCLUSTER alpha" in done.stdout


def test_the_skip_only_root_avoids_is_expected_of_other_users_alone(tmp_path: Path):
    done = report(tmp_path, RECORD, OUTPUT, EXPECTED_TEXT, "false")
    assert done.returncode == 1, done.stdout
    assert "  - SKIPPED alpha::three: needs root" in done.stdout
    record = RECORD + "SKIPPED alpha::three: needs root\n"
    assert report(tmp_path, record, OUTPUT, EXPECTED_TEXT, "false").returncode == 0
    assert report(tmp_path, record, OUTPUT, EXPECTED_TEXT, "true").returncode == 1


def test_a_skip_for_an_api_not_served_is_expected_only_where_it_is_not(tmp_path: Path):
    skipped = RECORD + "SKIPPED alpha::one: the whole test: needs networking.k8s.io/v1 ipaddresses\n"
    done = report(tmp_path, skipped, OUTPUT, EXPECTED_TEXT, "true", "without-ipaddress-api")
    assert done.returncode == 0, done.stdout
    # Where the API is served the same skip is a new one, and its absence elsewhere is fine.
    done = report(tmp_path, skipped, OUTPUT, EXPECTED_TEXT, "true")
    assert done.returncode == 1, done.stdout
    assert "  + SKIPPED alpha::one: the whole test: needs networking.k8s.io/v1 ipaddresses" in done.stdout
    done = report(tmp_path, RECORD, OUTPUT, EXPECTED_TEXT, "true", "without-ipaddress-api")
    assert done.returncode == 1, done.stdout
    assert "  - SKIPPED alpha::one: the whole test: needs networking.k8s.io/v1 ipaddresses" in done.stdout


def test_a_skip_for_a_missing_audit_log_is_expected_only_where_there_is_none(tmp_path: Path):
    skipped = RECORD + "SKIPPED gamma::five: the whole test: needs the audit log\n"
    done = report(tmp_path, skipped, OUTPUT, EXPECTED_TEXT, "true", "without-audit-log")
    assert done.returncode == 0, done.stdout
    done = report(tmp_path, skipped, OUTPUT, EXPECTED_TEXT, "true")
    assert done.returncode == 1, done.stdout
    assert "  + SKIPPED gamma::five: the whole test: needs the audit log" in done.stdout
    done = report(tmp_path, RECORD, OUTPUT, EXPECTED_TEXT, "true",
                  "without-ipaddress-api", "without-audit-log")
    assert done.returncode == 1, done.stdout
    assert "  - SKIPPED gamma::five: the whole test: needs the audit log" in done.stdout


def test_a_run_where_nothing_ran_against_the_cluster_fails(tmp_path: Path):
    record = "".join(line + "\n" for line in RECORD.splitlines() if line.startswith("SKIPPED"))
    expected = EXPECTED_TEXT + "NOCLUSTER alpha\n"
    done = report(tmp_path, record, OUTPUT, expected, "true")
    assert done.returncode == 1, done.stdout
    assert "no test ran against the cluster" in done.stdout


# A stand-in cargo: `cargo build` and `cargo test --no-run` are only noted in the calls; `cargo
# test` writes what the suite's tests would record where BOOTSTRAP_E2E_SKIP_LOG says, prints
# cargo's `Running` lines, and exits with FAKE_CARGO_STATUS; its arguments go to a file. A run of
# `--test no_fight` alone reads and writes the files named with `.no_fight` after them instead.
FAKE_CARGO = r'''#!/usr/bin/env bash
set -euo pipefail
case " $* " in
  " build "* | *" --no-run "*) echo "cargo $*" >>"$FAKE_DIR/calls"; exit 0 ;;
esac
suffix=
case " $* " in *" --test no_fight --no-fail-fast "*) suffix=.no_fight ;; esac
printf '%s\n' "$@" >"$FAKE_DIR/cargo-args$suffix"
env | grep '^BOOTSTRAP_E2E_' | sort >"$FAKE_DIR/cargo-env$suffix"
cat "$FAKE_DIR/record$suffix" >>"$BOOTSTRAP_E2E_SKIP_LOG"
cat "$FAKE_DIR/output$suffix"
if [ -n "$suffix" ]; then exit "${FAKE_NO_FIGHT_STATUS:-0}"; fi
exit "${FAKE_CARGO_STATUS:-0}"
'''


# Stand-ins for the control plane: build.sh names a directory whose kube-apiserver only says its
# version, up.sh writes the env file test.sh reads, curl answers discovery from $FAKE_DIR/discovery.
STAND_INS = {
    "build.sh": 'echo "build.sh $*" >>"$FAKE_DIR/calls"\necho "$FAKE_DIR/bin"\n',
    "up.sh": 'echo "up.sh $*" >>"$FAKE_DIR/calls"\n'
             'printf "APISERVER_1_URL=https://127.0.0.1:1\\nSERVICE_CLUSTER_IP_RANGE=10.96.0.0/12\\n"'
             ' >"$1/env"\n',
    "down.sh": 'echo "down.sh $*" >>"$FAKE_DIR/calls"\n',
}
FAKE_CURL = '#!/usr/bin/env bash\ncat "$FAKE_DIR/discovery"\n'
SERVES_IPADDRESSES = '{"kind": "APIResourceList", "resources": [{"name": "ipaddresses"}]}'


def run_test_sh(tmp: Path, record: str, *args: str, cargo_status: int = 0,
                discovery: str = SERVES_IPADDRESSES, output: str = OUTPUT_ALPHA,
                no_fight: tuple[str, str, int] | None = None):
    """test.sh as CI runs it, from a copy of e2e/control-plane beside stand-ins for build.sh,
    up.sh and down.sh (the control plane) and on a PATH with the stand-in cargo and curl. With
    `no_fight` (what that file records and prints, and its exit status), the suite has a test file
    no_fight too."""
    copy = tmp / "repo" / "e2e" / "control-plane"
    copy.mkdir(parents=True)
    for name in ("test.sh", "skips.sh"):
        shutil.copy(CONTROL_PLANE / name, copy / name)
    tests = tmp / "repo" / "e2e" / "tests"
    tests.mkdir()
    for name in ("alpha", "gamma") + (("no_fight",) if no_fight else ()):
        (tests / f"{name}.rs").write_text("")
    (copy / "expected-skips.txt").write_text(EXPECTED_TEXT)
    for name, body in STAND_INS.items():
        (copy / name).write_text(f"#!/usr/bin/env bash\n{body}")
        (copy / name).chmod(0o755)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, body in (("cargo", FAKE_CARGO), ("curl", FAKE_CURL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    state = tmp / "state"
    state.mkdir()
    (state / "bin").mkdir()
    (state / "bin" / "kube-apiserver").write_text("#!/bin/sh\necho Kubernetes v1.99.0\n")
    (state / "bin" / "kube-apiserver").chmod(0o755)
    (state / "discovery").write_text(discovery)
    (state / "record").write_text(record)
    (state / "output").write_text(output)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_DIR": str(state),
           "FAKE_CARGO_STATUS": str(cargo_status), "TMPDIR": str(tmp)}
    if no_fight:
        (state / "record.no_fight").write_text(no_fight[0])
        (state / "output.no_fight").write_text(no_fight[1])
        env["FAKE_NO_FIGHT_STATUS"] = str(no_fight[2])
    done = subprocess.run([str(copy / "test.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    return done, state


def as_root() -> bool:
    return os.geteuid() == 0


def test_test_sh_records_the_skips_and_compares_the_whole_suite(tmp_path: Path):
    # The skip only root avoids, as this user would see it.
    record = RECORD_ALPHA + ("" if as_root() else "SKIPPED alpha::three: needs root\n")
    done, state = run_test_sh(tmp_path, record)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "  SKIPPED alpha::two: the whole test: needs the simulator\n" in done.stdout
    assert "test files alpha ran: compared with their lines" in done.stdout
    args = (state / "cargo-args").read_text().splitlines()
    assert args[:5] == ["test", "--color", "never", "-p", "e2e"], args
    # The file that runs nothing against a given cluster is not run again.
    assert args[5:7] == ["--test", "alpha"] and "gamma" not in args, args
    assert args[-2:] == ["--", "--test-threads=1"], args
    env = (state / "cargo-env").read_text()
    assert "BOOTSTRAP_E2E_SKIP_LOG=" in env and "BOOTSTRAP_E2E_KUBECONFIG=" in env, env
    assert "BOOTSTRAP_E2E_SERVICE_RANGE=10.96.0.0/12" in env, env
    calls = (state / "calls").read_text().splitlines()
    # The binaries the tests run are built first: `cargo test -p e2e` does not build them.
    assert [c.split()[0] for c in calls] == ["build.sh", "up.sh", "cargo", "down.sh"], calls
    assert calls[1].endswith(f"--bin {state}/bin"), calls
    assert calls[2] == "cargo build --color never -p bootstrap-controller -p apiserver-sim --bins", calls
    # The record and cargo's output are removed (the control plane's directory stays, with its
    # logs, as down.sh leaves it).
    left = list(tmp_path.glob("control-plane-e2e-skips-*")) + list(
        tmp_path.glob("control-plane-e2e-output-*"))
    assert not left, left


NO_FIGHT_RECORD = "CLUSTER no_fight::judged: runs against the given cluster\n"
NO_FIGHT_OUTPUT = "     Running tests/no_fight.rs (target/debug/deps/no_fight-0123456789abcdef)\n"


def test_test_sh_runs_no_fight_beside_the_suite_on_a_control_plane_of_its_own(tmp_path: Path):
    record = RECORD_ALPHA + ("" if as_root() else "SKIPPED alpha::three: needs root\n")
    done, state = run_test_sh(tmp_path, record, no_fight=(NO_FIGHT_RECORD, NO_FIGHT_OUTPUT, 0))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test files alpha no_fight ran: compared with their lines" in done.stdout
    args = (state / "cargo-args").read_text().splitlines()
    assert "no_fight" not in args and args[5:7] == ["--test", "alpha"], args
    apart_args = (state / "cargo-args.no_fight").read_text().splitlines()
    assert apart_args[5:] == ["--test", "no_fight", "--no-fail-fast", "--", "--test-threads=1"]
    calls = (state / "calls").read_text().splitlines()
    ups = [c.split()[1] for c in calls if c.startswith("up.sh ")]
    downs = sorted(c.split()[1] for c in calls if c.startswith("down.sh "))
    assert len(ups) == 2 and ups[1] == ups[0] + "/apart", calls
    assert downs == sorted(ups), calls
    # Both runs are built before either runs.
    built = [c for c in calls if "--no-run" in c]
    assert built and "--test alpha" in built[0] and "--test no_fight" in built[0], calls
    apart_env = (state / "cargo-env.no_fight").read_text()
    assert f"BOOTSTRAP_E2E_KUBECONFIG={ups[1]}/admin.kubeconfig" in apart_env, apart_env
    assert "== no_fight, on its own control plane (exit status 0)" in done.stdout
    assert NO_FIGHT_OUTPUT in done.stdout


def test_test_sh_fails_when_no_fight_beside_the_suite_fails_or_skips_unexpectedly(
        tmp_path: Path):
    record = RECORD_ALPHA + ("" if as_root() else "SKIPPED alpha::three: needs root\n")
    done, _ = run_test_sh(tmp_path / "failed", record,
                          no_fight=(NO_FIGHT_RECORD, NO_FIGHT_OUTPUT, 101))
    assert done.returncode == 101, done.stdout + done.stderr
    assert "(exit status 101)" in done.stdout
    skipped = NO_FIGHT_RECORD + "SKIPPED no_fight::judged: a new reason\n"
    done, _ = run_test_sh(tmp_path / "skipped", record,
                          no_fight=(skipped, NO_FIGHT_OUTPUT, 0))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "  + SKIPPED no_fight::judged: a new reason" in done.stdout


def test_test_sh_fails_on_an_unexpected_skip_even_when_every_test_passed(tmp_path: Path):
    record = RECORD_ALPHA + "SKIPPED alpha::one: a new reason\n"
    done, _ = run_test_sh(tmp_path, record)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "  + SKIPPED alpha::one: a new reason" in done.stdout


def test_test_sh_keeps_the_suites_failure(tmp_path: Path):
    record = RECORD_ALPHA + ("" if as_root() else "SKIPPED alpha::three: needs root\n")
    done, _ = run_test_sh(tmp_path, record, cargo_status=101)
    assert done.returncode == 101, done.stdout + done.stderr
    assert "  SKIPPED alpha::two: the whole test: needs the simulator\n" in done.stdout


def test_test_sh_takes_the_version_and_flags_and_asks_discovery_for_the_ipaddress_api(
        tmp_path: Path):
    record = (RECORD_ALPHA + ("" if as_root() else "SKIPPED alpha::three: needs root\n")
              + "SKIPPED alpha::one: the whole test: needs networking.k8s.io/v1 ipaddresses\n")
    done, state = run_test_sh(tmp_path, record, "--kubernetes", "1.30", "--apiserver-flag",
                              "--emulated-version=1.29", "--controller-manager-flag",
                              "--controllers=*", discovery='{"resources": []}')
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Kubernetes v1.99.0 (--apiserver-flag --emulated-version=1.29" in done.stdout
    assert "without-ipaddress-api" in done.stdout
    calls = (state / "calls").read_text().splitlines()
    assert calls[0] == "build.sh --kubernetes 1.30", calls
    assert calls[1].endswith(" --apiserver-flag --emulated-version=1.29 "
                             "--controller-manager-flag --controllers=*"), calls
    # Where discovery lists the API, the same skip is unexpected.
    done, _ = run_test_sh(tmp_path / "served", record, "--kubernetes", "1.30")
    assert done.returncode == 1, done.stdout + done.stderr


def test_test_sh_lists_but_does_not_compare_a_part_of_the_suite(tmp_path: Path):
    done, state = run_test_sh(tmp_path, "CLUSTER alpha::one: x\n", "--test", "alpha", "--",
                              "one")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not compared" in done.stdout
    args = (state / "cargo-args").read_text().splitlines()
    assert args[5:7] == ["--test", "alpha"], args
    assert args[-1] == "one", args


def test_test_sh_compares_whole_test_files_with_their_lines_alone(tmp_path: Path):
    # alpha's lines: its skip of `two`, and (not as root) of `three`; gamma's are not expected.
    record = ("CLUSTER alpha::one: x\nSKIPPED alpha::two: the whole test: needs the simulator\n"
              + ("" if as_root() else "SKIPPED alpha::three: needs root\n"))
    done, _ = run_test_sh(tmp_path, record, "--test", "alpha")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test files alpha ran: compared with their lines" in done.stdout
    done, _ = run_test_sh(tmp_path / "missing", "CLUSTER alpha::one: x\n", "--test", "alpha")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "  - SKIPPED alpha::two: the whole test: needs the simulator" in done.stdout


def test_the_expected_list_names_real_tests_and_test_files():
    tests = ROOT / "e2e" / "tests"
    lines = [line for line in EXPECTED.read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines, "expected-skips.txt is empty"
    for line in lines:
        line = (line.removeprefix("unless-root ").removeprefix("without-ipaddress-api ")
                .removeprefix("without-audit-log "))
        kind, _, rest = line.partition(" ")
        if kind == "NOCLUSTER":
            source = (tests / f"{rest}.rs").read_text()
            # A file listed as running nothing against the cluster never asks for it.
            assert "Target::start" not in source, line
            continue
        assert kind == "SKIPPED", line
        name, _, reason = rest.partition(": ")
        assert reason, line
        file, _, test = name.partition("::")
        source = (tests / f"{file}.rs").read_text()
        assert re.search(rf"\bfn {re.escape(test)}\(", source), line
    # Every test file either asks for the cluster or is listed as running nothing against it.
    listed = {line.split()[-1] for line in lines if line.startswith("NOCLUSTER ")}
    for source in sorted(tests.glob("*.rs")):
        asks = re.search(r"Target::start|\bseeded\(|\bcluster\(\)|one_member_listed\(",
                         source.read_text())
        assert bool(asks) != (source.stem in listed), source.stem
