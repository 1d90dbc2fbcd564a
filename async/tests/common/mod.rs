//! What the async tests share: a reactor state holding the executor, serial execution,
//! and a bounded wait.

#![allow(dead_code)]

use std::sync::Mutex;
use std::time::{Duration, Instant};

use hypoll_async::{Executor, HasExecutor};
use hypoll_reactor::{
    allowed_cores, CoreList, Device, DeviceId, DeviceOptions, ReactorConfig, ReactorSet,
};

/// Each reactor's state in these tests: the executor, and the device attached (if any).
pub struct App {
    pub executor: Executor<App>,
    pub device: Option<DeviceId>,
}

impl HasExecutor for App {
    fn executor(&self) -> &Executor<App> {
        &self.executor
    }
}

/// Tests run one at a time: reactors spin, and the machines have as few as two cores.
static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Up to `n` reactors on the cores this process may use.
pub fn config(n: usize) -> ReactorConfig {
    let cores = allowed_cores().unwrap().into_iter().take(n).collect();
    ReactorConfig {
        cores: Some(CoreList::new(cores)),
        ..ReactorConfig::default()
    }
}

/// `n` reactors with executors, each with `device` (if any) attached as `options` say.
pub fn start(n: usize, device: Option<(Device, DeviceOptions)>) -> ReactorSet<App> {
    ReactorSet::start(config(n), move |r| {
        let device = match &device {
            Some((device, options)) => Some(r.attach_with(device, *options)?),
            None => None,
        };
        Ok(App {
            executor: Executor::install(r)?,
            device,
        })
    })
    .unwrap()
}

/// Waits until `cond` holds, for up to 10 s.
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}
