//! The `hypoll` binary as a user runs it: short benches, JSON, verify, bad input.

use std::process::Command;

fn hypoll(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hypoll"))
        .args(args)
        .output()
        .expect("hypoll runs")
}

#[test]
fn bench_writes_json_with_every_field_and_verify_finds_no_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let plot = dir.path().join("out.svg");
    let out = hypoll(&[
        "bench",
        "--device",
        "emu:nand,size=64M",
        "--policy",
        "classic",
        "--policy",
        "hybrid",
        "--policy",
        "oracle",
        "--qd",
        "4",
        "--runtime",
        "0.3",
        "--ramp",
        "0.2",
        "--repeat",
        "2",
        "--verify",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for policy in ["classic", "hybrid", "oracle"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(policy)),
            "{policy} row:\n{stdout}"
        );
    }
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    // One row per policy, in the order asked for, each the median of its 2 runs (the
    // repeats go in rounds).
    let names: Vec<_> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["classic", "hybrid", "oracle"]);
    // classic never sleeps; hybrid sleeps half the mean latency of the statistics window
    // before, which tracks the run's mean (loosely: windows differ, and an unoptimised
    // build queues more).
    assert!(rows[0]["sleep_mean_ns"].is_null(), "{}", rows[0]);
    let hybrid_sleep_ns = rows[1]["sleep_mean_ns"].as_f64().unwrap();
    let hybrid_mean_ns = rows[1]["lat_ns"]["mean"].as_f64().unwrap();
    assert!(
        (0.2..0.8).contains(&(hybrid_sleep_ns / hybrid_mean_ns)),
        "{hybrid_sleep_ns} against a mean of {hybrid_mean_ns}"
    );
    for row in rows {
        assert_eq!(row["runs"], 2);
        for field in [
            "policy",
            "device",
            "rw",
            "bs",
            "qd",
            "cores",
            "iops",
            "cpu_pct",
            "iops_per_cpu_pct",
            "lat_ns",
            "ios",
            "errors",
        ] {
            assert!(row.get(field).is_some(), "missing {field}: {row}");
        }
        for field in ["mean", "p50", "p99", "p9999", "max"] {
            assert!(
                row["lat_ns"].get(field).is_some(),
                "missing lat_ns.{field}: {row}"
            );
        }
        assert_eq!(row["rw"], "randread");
        assert_eq!(row["bs"], 4096);
        assert_eq!(row["qd"], 4);
        assert_eq!(row["errors"], 0);
        assert_eq!(row["mismatches"], 0);
        assert!(row["ios"].as_u64().unwrap() > 0);
        assert!(row["iops"].as_f64().unwrap() > 0.0);
        let cpu = row["cpu_pct"].as_f64().unwrap();
        assert!(cpu > 0.0 && cpu <= 101.0, "{cpu}");
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("hybrid"),
        "an SVG naming the policies"
    );
}

#[test]
fn every_workload_shape_runs() {
    for rw in ["randwrite", "read", "write", "randrw:70"] {
        let out = hypoll(&[
            "bench",
            "--device",
            "null",
            "--policy",
            "classic",
            "--rw",
            rw,
            "--bs",
            "8k",
            "--qd",
            "8",
            "--runtime",
            "0.1",
            "--ramp",
            "0",
        ]);
        assert!(
            out.status.success(),
            "{rw}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn bench_drives_the_same_workload_through_callbacks_and_through_async_tasks() {
    let dir = tempfile::tempdir().unwrap();
    for api in ["callback", "async"] {
        for (rw, qd) in [("randread", "1"), ("randrw:50", "16")] {
            let json = dir.path().join(format!("{api}-{qd}.json"));
            let out = hypoll(&[
                "bench",
                "--device",
                "null",
                "--policy",
                "classic",
                "--policy",
                "adaptive",
                "--api",
                api,
                "--rw",
                rw,
                "--qd",
                qd,
                "--runtime",
                "0.2",
                "--ramp",
                "0.1",
                "--json",
                json.to_str().unwrap(),
            ]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{api} {rw} qd {qd}: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                stdout
                    .lines()
                    .next()
                    .unwrap()
                    .contains(&format!("api {api}")),
                "{stdout}"
            );
            let rows: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
            for row in rows.as_array().unwrap() {
                assert_eq!(row["api"], api, "{row}");
                assert_eq!(row["errors"], 0, "{row}");
                // Every I/O of the measured window was counted, with its latency.
                let ios = row["ios"].as_u64().unwrap();
                assert!(ios > 1_000, "{api}: {ios} I/Os in 0.2 s on null: {row}");
                assert!(row["lat_ns"]["mean"].as_f64().unwrap() > 0.0, "{row}");
            }
        }
    }
}

#[test]
fn bad_input_is_one_line_naming_the_value_and_exit_status_2() {
    for (args, says) in [
        (&["bench", "--device", "emu:floppy"][..], "floppy"),
        (&["bench", "--policy", "turbo"][..], "turbo"),
        (&["bench", "--rw", "sideways"][..], "sideways"),
        (&["bench", "--api", "futures"][..], "futures"),
        (&["bench", "--bs", "1000"][..], "1000"),
        (&["bench", "--cores", "4000"][..], "4000"),
        (
            &["bench", "--device", "null", "--policy", "oracle"][..],
            "oracle",
        ),
        (&["bench", "--device", "null", "--verify"][..], "--verify"),
        (&["bench", "--alternate", "100"][..], "two --policy"),
        (
            &["bench", "--alternate", "5", "--policy", "classic"][..],
            "--alternate",
        ),
        (
            &[
                "bench",
                "--device",
                "emu:nand",
                "--policy",
                "classic",
                "--policy",
                "oracle",
                "--alternate",
                "100",
            ][..],
            "oracle",
        ),
        (
            &[
                "bench",
                "--policy",
                "classic",
                "--policy",
                "hybrid",
                "--alternate",
                "100",
                "--runtime",
                "0.25",
            ][..],
            "--runtime",
        ),
        (
            &["bench", "--device", "emu:optane,jitter=lots"][..],
            "jitter",
        ),
        (
            &[
                "serve",
                "--export",
                "m=null",
                "--unix-owner",
                "no-such-user-here",
            ][..],
            "no-such-user-here",
        ),
        (
            &["serve", "--export", "m=null", "--unix-owner", ":"][..],
            "USER:GROUP",
        ),
    ] {
        let out = hypoll(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let first = stderr.lines().next().unwrap_or_default();
        assert!(first.contains(says), "{args:?}: {stderr}");
    }
}

#[test]
fn policies_lists_every_policy() {
    let out = hypoll(&["policies"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for name in [
        "classic",
        "interrupt",
        "hybrid",
        "fixed:<us>",
        "hybrid-3/4",
        "hybrid-min",
        "uring-hybrid",
        "oracle",
    ] {
        assert!(text.lines().any(|l| l.starts_with(name)), "{name}:\n{text}");
    }
}

#[test]
fn bench_on_an_io_uring_file_runs_every_policy_and_verifies() {
    // A file of real data: a sparse one would never reach the device.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("disk.img");
    let data: Vec<u8> = (0..16u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    let spec = format!("uring:{}", path.display());
    let out = hypoll(&[
        "bench",
        "--device",
        &spec,
        "--rw",
        "randrw:70",
        "--qd",
        "4",
        "--runtime",
        "0.2",
        "--ramp",
        "0.1",
        "--verify",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The header says how completions are found; every built-in policy ran (no oracle:
    // it needs an emulated device).
    let header = stdout.lines().next().unwrap_or_default();
    assert!(header.contains("completions"), "{header}");
    for policy in hypoll_policy::list()
        .iter()
        .map(|p| p.name)
        .filter(|n| *n != "oracle")
    {
        assert!(
            stdout.lines().any(|l| l.starts_with(policy)),
            "{policy} row:\n{stdout}"
        );
    }
    let missing = hypoll(&["bench", "--device", "uring:/nonexistent/disk.img"]);
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains("no such file"), "{stderr}");
}

/// The server library names a refused setting by its field; the binary says which flag set
/// it, as the user wrote it.
#[test]
fn serve_names_the_flag_of_a_refused_setting() {
    for (flag, value, says) in [
        (
            "--max-connections",
            "0",
            "--max-connections 0: expected 1 to",
        ),
        (
            "--max-request-bytes",
            "1000",
            "--max-request-bytes 1000: expected a multiple of 4096",
        ),
        (
            "--max-connection-bytes",
            "4K",
            "--max-connection-bytes 4096: expected 64K to 64G",
        ),
    ] {
        let out = hypoll(&[
            "serve",
            "--export",
            "mem=null",
            "--listen",
            "127.0.0.1:0",
            flag,
            value,
        ]);
        assert!(!out.status.success(), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let first = stderr.lines().next().unwrap_or_default();
        assert_eq!(
            first
                .strip_prefix("hypoll serve: ")
                .map(|m| m.starts_with(says)),
            Some(true),
            "{stderr}"
        );
    }
}

/// The "run 1: ..." line of `--alternate`: the latency ratio and the CPU points.
fn paired_line(stdout: &str) -> (f64, f64) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("run 1:"))
        .unwrap_or_else(|| panic!("no comparison line:\n{stdout}"));
    let after = |key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
        let number: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit() || "+-.".contains(*c))
            .collect();
        number.parse().unwrap_or_else(|_| panic!("{key} in {line}"))
    };
    (after("mean latency"), after("CPU"))
}

#[test]
fn alternate_runs_two_policies_in_turns_and_compares_them_segment_by_segment() {
    // `fixed:200` sleeps 200 us for every read of a device that answers many times
    // faster: far later than `classic`, on a fraction of its CPU, even on a machine busy
    // with other tests. Were the turns not taken (every decision made by one of the two),
    // the rows would be alike.
    let json_dir = tempfile::tempdir().unwrap();
    let json = json_dir.path().join("alt.json");
    let run = |b: &str| {
        hypoll(&[
            "bench",
            "--device",
            "emu:optane",
            "--policy",
            "classic",
            "--policy",
            b,
            "--alternate",
            "25",
            "--runtime",
            "1.5",
            "--ramp",
            "0.2",
            "--json",
            json.to_str().unwrap(),
        ])
    };
    let out = run("fixed:200");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("take turns every 25 ms"), "{stdout}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cpu = |i: usize| rows[i]["cpu_pct"].as_f64().unwrap();
    let mean = |i: usize| rows[i]["lat_ns"]["mean"].as_f64().unwrap();
    assert_eq!(rows[0]["policy"], "classic");
    assert_eq!(rows[1]["policy"], "fixed:200");
    assert!(cpu(1) < 0.5 * cpu(0), "{rows}");
    assert!(mean(1) > 5.0 * mean(0), "{rows}");
    let (ratio, points) = paired_line(&stdout);
    assert!(ratio > 5.0, "{stdout}");
    assert!(points < -20.0, "{stdout}");
    assert_eq!(rows[1]["alternate_ms"], 25, "{rows}");
    // The paired line, in the JSON too, on the second policy's row.
    let json_run = &rows[1]["paired"]["runs"][0];
    assert_eq!(rows[1]["paired"]["against"], "classic", "{rows}");
    assert_eq!(rows[0]["paired"], serde_json::Value::Null, "{rows}");
    let json_ratio = json_run["latency_ratio"].as_f64().unwrap();
    assert!(
        (json_ratio / ratio - 1.0).abs() < 0.01,
        "{json_ratio} against {ratio}"
    );
    assert!(
        (json_run["cpu_points"].as_f64().unwrap() - points).abs() < 0.1,
        "{rows}"
    );

    // Against itself: alike, on the same footing (a wide band: other tests share the core).
    let out = run("classic");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.lines().any(|l| l.starts_with("classic (twin)")),
        "{stdout}"
    );
    let (ratio, _) = paired_line(&stdout);
    assert!((0.8..1.25).contains(&ratio), "{stdout}");
}
