//! `hypoll sim` as a user runs it: a few seeds, one seed replayed, bad input.

use std::process::Command;

fn hypoll(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hypoll"))
        .args(args)
        .output()
        .expect("hypoll runs")
}

#[test]
fn sim_runs_seeds_and_replays_one_exactly() {
    let out = hypoll(&["sim", "--seeds", "5", "--first", "20"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("5 seeds from 20 passed"), "{stdout}");
    // No recovery log lines without --verbose, though those seeds time I/O out.
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // One seed, twice: the same report.
    let once = hypoll(&["sim", "--seed", "21"]);
    let again = hypoll(&["sim", "--seed", "21"]);
    assert!(once.status.success());
    let report = |o: &std::process::Output| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        report(&once).starts_with("SimReport { seed: 21"),
        "{}",
        report(&once)
    );
    assert_eq!(report(&once), report(&again));

    let bad = hypoll(&["sim", "--fault-scale", "11"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--fault-scale"));
}
