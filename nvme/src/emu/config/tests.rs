//! Tests of the emulated controller's configuration: profiles, keys and their bounds, and
//! device strings that print as they parse.

use std::path::PathBuf;

use super::keys::{Key, KEYS};
use super::*;

#[test]
fn every_profile_resolves_and_overrides_apply() {
    for name in profile_names() {
        let cfg = EmuConfig::profile(name).unwrap();
        assert!(cfg.read_us > 0.0 && cfg.parallel >= 1, "{name}");
        cfg.validate().unwrap();
    }
    let mut cfg = EmuConfig::profile("nand").unwrap();
    cfg.set("read_us", "23").unwrap();
    cfg.set("jitter", "0.3").unwrap();
    cfg.set("seed", "7").unwrap();
    cfg.set("size", "8G").unwrap();
    cfg.set("lba", "4096").unwrap();
    cfg.set("backing", "file:/tmp/x.img").unwrap();
    assert_eq!(cfg.read_us, 23.0);
    assert_eq!(cfg.jitter, 0.3);
    assert_eq!(cfg.seed, 7);
    assert_eq!(cfg.size_bytes, 8 << 30);
    assert_eq!(cfg.lba_bytes, 4096);
    assert_eq!(cfg.backing, Backing::File("/tmp/x.img".into()));
}

fn parse(text: &str) -> EmuConfig {
    match text.parse::<crate::DeviceConfig>().unwrap() {
        crate::DeviceConfig::Emu(cfg) => cfg,
        other => panic!("not emu: {other:?}"),
    }
}

#[test]
fn device_strings_name_the_profile_and_what_differs_from_it() {
    assert_eq!(
        EmuConfig::profile("optane").unwrap().to_string(),
        "emu:optane"
    );
    let mut cfg = EmuConfig::profile("nand").unwrap();
    cfg.read_us = 23.0;
    cfg.size_bytes = 8 << 30;
    assert_eq!(cfg.to_string(), "emu:nand,read_us=23,size=8G");
    assert_eq!(
        EmuConfig::zero_latency().to_string(),
        "emu:dram,read_us=0,write_us=0,jitter=0,tail_pct=0,tail_us=0,mbps=1000000000000"
    );
}

#[test]
fn device_strings_round_trip() {
    let mut odd = EmuConfig::profile("zssd").unwrap();
    odd.read_us = 0.1 + 0.2; // not exactly 0.3: the text must carry every bit
    odd.jitter = 1.0 / 3.0;
    odd.mbps = 1234.5678;
    odd.size_bytes = 3 * 512 + (5 << 20);
    odd.mdts_bytes = 4096;
    odd.seed = u64::MAX;
    for cfg in [
        EmuConfig::profile("optane").unwrap(),
        EmuConfig::zero_latency(),
        parse("emu:nand,read_us=23,jitter=0.3,seed=7"),
        parse("emu:p5800x,size=1G,lba=4096,mdts=2M,backing=ram,queues=3,parallel=1"),
        parse("emu:dram,err_pct=1.5,lost_pct=0.25,reset_pct=0.001,tail_us=7.75"),
        parse("emu:optane,lost_pct=5,stuck_pct=50"),
        parse("emu:optane,backing=file:/tmp/ns.img,size=8G"),
        odd,
    ] {
        cfg.validate().unwrap();
        let text = cfg.to_string();
        assert_eq!(parse(&text), cfg, "{text}");
        assert_eq!(
            crate::DeviceConfig::Emu(cfg.clone()).to_string(),
            text,
            "DeviceConfig says the same"
        );
    }
}

#[test]
fn zero_latency_makes_transfers_free_too() {
    let mut model = super::super::latency::LatencyModel::new(&EmuConfig::zero_latency(), 0);
    for bytes in [512, 4096, 128 << 10, 2 << 20] {
        assert_eq!(
            model.sample_ns(super::super::latency::LatencyClass::Read, bytes),
            0,
            "{bytes} bytes"
        );
    }
}

#[test]
fn keys_and_their_names_agree() {
    for (i, k) in KEYS.iter().enumerate() {
        assert_eq!(k.name(), EMU_KEYS[i]);
        assert_eq!(Key::from_name(EMU_KEYS[i]), Some(*k));
    }
    assert_eq!(Key::from_name("colour"), None);
}

/// Each bound, as a device string meets it and as a struct-built configuration meets it:
/// `set` refuses the value (and leaves the configuration unchanged), `validate` names
/// the key.
#[test]
fn every_key_is_bounded_in_set_and_in_validate() {
    type Poke = fn(&mut EmuConfig);
    let cases: &[(&str, &str, Poke)] = &[
        ("read_us", "1e300", |c| c.read_us = 1e300),
        ("read_us", "10000000.5", |c| c.read_us = 10_000_000.5),
        ("write_us", "-1", |c| c.write_us = -1.0),
        ("tail_us", "NaN", |c| c.tail_us = f64::NAN),
        ("tail_us", "inf", |c| c.tail_us = f64::INFINITY),
        ("jitter", "10.01", |c| c.jitter = 10.01),
        ("jitter", "NaN", |c| c.jitter = f64::NAN),
        ("tail_pct", "100.1", |c| c.tail_pct = 100.1),
        ("err_pct", "-0.5", |c| c.err_pct = -0.5),
        ("lost_pct", "NaN", |c| c.lost_pct = f64::NAN),
        ("reset_pct", "200", |c| c.reset_pct = 200.0),
        ("stuck_pct", "100.5", |c| c.stuck_pct = 100.5),
        ("parallel", "0", |c| c.parallel = 0),
        ("parallel", "4097", |c| c.parallel = 4097),
        ("mbps", "0", |c| c.mbps = 0.0),
        ("mbps", "0.5", |c| c.mbps = 0.5),
        ("mbps", "inf", |c| c.mbps = f64::INFINITY),
        ("mbps", "NaN", |c| c.mbps = f64::NAN),
        ("mbps", "2e12", |c| c.mbps = 2e12),
        ("size", "0", |c| c.size_bytes = 0),
        ("lba", "1024", |c| c.lba_bytes = 1024),
        ("mdts", "3000", |c| c.mdts_bytes = 3000),
        ("mdts", "2048", |c| c.mdts_bytes = 2048),
        ("mdts", "4M", |c| c.mdts_bytes = 4 << 20),
        ("backing", "file:", |c| {
            c.backing = Backing::File(PathBuf::new())
        }),
        ("queues", "0", |c| c.queues_max = 0),
        ("queues", "1025", |c| c.queues_max = 1025),
    ];
    for &(key, text, poke) in cases {
        let good = EmuConfig::profile("nand").unwrap();
        let mut cfg = good.clone();
        let err = cfg.set(key, text).unwrap_err().to_string();
        assert!(
            err.contains(key) && err.contains("expected"),
            "{key}={text}: {err}"
        );
        assert_eq!(cfg, good, "a refused value changes nothing ({key}={text})");
        poke(&mut cfg);
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(key), "validate on {key}={text}: {err}");
        let err = crate::EmuController::new(cfg).err().expect("refused");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{key}={text}");
    }
    // The edges themselves are accepted.
    let mut cfg = EmuConfig::profile("nand").unwrap();
    for (key, text) in [
        ("read_us", "10000000"),
        ("write_us", "0"),
        ("jitter", "10"),
        ("tail_pct", "100"),
        ("parallel", "4096"),
        ("mbps", "1"),
        ("mbps", "1000000000000"),
        ("mdts", "2M"),
        ("queues", "1024"),
    ] {
        cfg.set(key, text)
            .unwrap_or_else(|e| panic!("{key}={text}: {e}"));
    }
    cfg.validate().unwrap();
    // Cross-field and profile checks.
    let mut cfg = EmuConfig::profile("nand").unwrap();
    cfg.lba_bytes = 4096;
    cfg.size_bytes = 4096 * 3 + 512;
    assert!(cfg.validate().is_err());
    let cfg = EmuConfig {
        profile: "floppy",
        ..EmuConfig::profile("nand").unwrap()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("floppy"), "{err}");
}

#[test]
fn bad_values_name_the_key_and_what_is_accepted() {
    let mut cfg = EmuConfig::profile("optane").unwrap();
    let err = cfg.set("lba", "1024").unwrap_err().to_string();
    assert!(err.contains("lba") && err.contains("512 or 4096"), "{err}");
    let err = cfg.set("jitter", "-1").unwrap_err().to_string();
    assert!(err.contains("jitter"), "{err}");
    let err = cfg.set("err_pct", "101").unwrap_err().to_string();
    assert!(err.contains("err_pct") && err.contains("0 to 100"), "{err}");
    let err = cfg.set("colour", "red").unwrap_err().to_string();
    assert!(err.contains("colour") && err.contains("read_us"), "{err}");
    let err = EmuConfig::profile("floppy").unwrap_err().to_string();
    assert!(err.contains("floppy") && err.contains("optane"), "{err}");
    cfg.set("size", "1000").unwrap();
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("multiple of the block size"), "{err}");
}
