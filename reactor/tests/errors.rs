//! The typed errors an embedder meets: each names its case as a variant and keeps the error
//! it came from as its source, from `Device::open` through `attach` to `ReactorSet::start`.

use std::error::Error;
use std::time::Duration;

use hypoll_reactor::{
    allowed_cores, AttachError, ConfigError, CoreList, Device, DeviceError, DeviceOptions,
    PolicySpecError, QueuePairError, ReactorConfig, ReactorSet, ReactorStartError, StartError,
    DEVICES_MAX,
};

fn one_core() -> ReactorConfig {
    ReactorConfig {
        cores: Some(CoreList::new(vec![allowed_cores().unwrap()[0]])),
        ..ReactorConfig::default()
    }
}

/// The messages of `e` and of every error under it, outermost first.
fn chain(e: &(dyn Error + 'static)) -> Vec<String> {
    let mut messages = vec![e.to_string()];
    let mut next = e.source();
    while let Some(e) = next {
        messages.push(e.to_string());
        next = e.source();
    }
    messages
}

#[test]
fn a_bad_device_string_is_the_parsers_own_error() {
    let err = Device::open("floppy").err().unwrap();
    match &err {
        DeviceError::Config(ConfigError::UnknownDevice { name }) => assert_eq!(name, "floppy"),
        other => panic!("expected Config(UnknownDevice), got {other:?}"),
    }
    let source = err.source().expect("the config error is the source");
    assert!(matches!(
        source.downcast_ref::<ConfigError>(),
        Some(ConfigError::UnknownDevice { .. })
    ));
}

#[test]
fn a_device_that_does_not_open_keeps_the_os_error() {
    let err = Device::open("uring:/nonexistent/disk.img").err().unwrap();
    let DeviceError::Open { spec, source } = &err else {
        panic!("expected Open, got {err:?}");
    };
    assert_eq!(spec, "uring:/nonexistent/disk.img");
    let io = err
        .source()
        .and_then(|s| s.downcast_ref::<std::io::Error>());
    assert!(io.is_some(), "the io::Error is the source: {err:?}");
    assert!(err.to_string().contains(&source.to_string()), "{err}");
}

#[test]
fn attach_refusals_are_typed() {
    let device = Device::open("null").unwrap();
    let set = ReactorSet::start(one_core(), move |r| {
        let zero = r.attach_with(
            &device,
            DeviceOptions::new(8).with_io_timeout(Some(Duration::ZERO)),
        );
        assert!(matches!(zero, Err(AttachError::ZeroIoTimeout)), "{zero:?}");
        let long = r.attach_with(&device, DeviceOptions::new(8).with_wait_queue(1 << 20));
        assert!(
            matches!(
                long,
                Err(AttachError::WaitQueueTooLong {
                    wait_queue: 1_048_576,
                    ..
                })
            ),
            "{long:?}"
        );
        // The controller's refusal is kept as itself.
        let shallow = r.attach(&device, 0).err().unwrap();
        let AttachError::QueuePair { source, .. } = &shallow else {
            panic!("expected QueuePair, got {shallow:?}");
        };
        assert!(matches!(source, QueuePairError::BadDepth { depth: 0, .. }));
        assert!(shallow
            .source()
            .is_some_and(|s| s.downcast_ref::<QueuePairError>().is_some()));
        Ok(())
    })
    .unwrap();
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn an_init_error_survives_into_the_start_error() {
    // One device over the limit: init returns the attach error with `?`.
    let device = Device::open("null,queues=128").unwrap();
    let err = ReactorSet::start(one_core(), move |r| {
        for _ in 0..=DEVICES_MAX {
            r.attach(&device, 1)?;
        }
        Ok(())
    })
    .err()
    .unwrap();
    let StartError::Reactor {
        source: ReactorStartError::Init(init),
        ..
    } = &err
    else {
        panic!("expected Reactor {{ Init }}, got {err:?}");
    };
    assert!(
        matches!(
            init.downcast_ref::<AttachError>(),
            Some(AttachError::TooManyDevices { max: DEVICES_MAX })
        ),
        "{init:?}"
    );
    // Walked as plain errors: the start error, the reactor's, the attach error.
    let messages = chain(&err);
    assert_eq!(messages.len(), 3, "{messages:?}");
    assert!(messages[2].contains(&format!("at most {DEVICES_MAX} devices")));

    // A panic in init is typed too.
    let err = ReactorSet::<()>::start(one_core(), |_| panic!("init exploded"))
        .err()
        .unwrap();
    assert!(
        matches!(
            &err,
            StartError::Reactor { source: ReactorStartError::Panicked { message }, .. }
                if message == "init exploded"
        ),
        "{err:?}"
    );
}

#[test]
fn a_bad_policy_is_the_registrys_own_error() {
    let cfg = ReactorConfig {
        policy: "warp-speed".into(),
        ..one_core()
    };
    let err = ReactorSet::start(cfg, |_| Ok(())).err().unwrap();
    match &err {
        StartError::Policy(PolicySpecError::UnknownPolicy { name }) => {
            assert_eq!(name, "warp-speed")
        }
        other => panic!("expected Policy(UnknownPolicy), got {other:?}"),
    }
    assert!(err
        .source()
        .is_some_and(|s| s.downcast_ref::<PolicySpecError>().is_some()));
}
