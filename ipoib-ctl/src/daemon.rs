//! The control loop of `ipoib-ctl attach`, on one tokio runtime (one thread) per attached
//! interface: the heartbeat is an interval branch, connected mode's [`Manager`] and its
//! engine are branches and tasks of the same runtime, and SIGINT/SIGTERM end it cleanly. A
//! wedged runtime therefore stops the heartbeat too, and the fast path's fail-safe sends
//! every packet UD.

use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};

use crate::{
    attach::{self, AttachError, Attached},
    clock::monotonic_ns,
    connmgr::{CmError, CmOptions, Manager},
    maps::MapsError,
    service::Notifier,
};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Attach(#[from] AttachError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    // Each says only its own part: the cause follows in the chain (`{:#}`).
    #[error("starting connected mode")]
    StartCm(#[source] CmError),
    #[error("connected mode")]
    Cm(#[from] CmError),
    #[error("the control loop's runtime: {0}")]
    Io(#[from] std::io::Error),
}

/// Where the loop writes its metrics (`attach --metrics-textfile`).
#[derive(Debug, Clone)]
pub struct MetricsOut {
    pub dir: std::path::PathBuf,
    pub per_peer: bool,
}

/// How often the metrics file is written: reading every peer from the maps costs a few
/// milliseconds at thousands of peers; scrapes come every 15 s or more.
pub const METRICS_EVERY: Duration = Duration::from_secs(5);

/// Connected mode for the loop: what to run it with, and whether it must start (an explicit
/// `--cm-device`) or may fall back to UD only.
pub struct CmSetup {
    pub options: CmOptions,
    pub required: bool,
}

/// Runs the control loop for `iface` (already attached as `att`) until SIGINT, SIGTERM or a
/// detach; connected mode too when `cm` is given (else why not).
pub fn run(
    iface: &str,
    att: Attached,
    cm: Result<CmSetup, String>,
    metrics: Option<MetricsOut>,
) -> Result<(), DaemonError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_async(iface, att, cm, metrics))
}

async fn run_async(
    iface: &str,
    mut att: Attached,
    cm: Result<CmSetup, String>,
    metrics: Option<MetricsOut>,
) -> Result<(), DaemonError> {
    let mut notify = Notifier::from_env();
    let mut ud_only = None;
    let mut manager = match cm {
        Ok(cm) => start_cm(iface, cm, &mut ud_only).await?,
        Err(why) => {
            ud_only = Some(why);
            None
        }
    };
    // Only now is this loop running: whoever waits for it (status: loop_pid) finds connected
    // mode set up, and the entries a killed predecessor left CM_UP already reset.
    att.state.loop_pid = Some(std::process::id());
    attach::write_state(&att.state)?;
    tracing::info!(
        "{} {iface} (ifindex {}, egress {:?}, xdp {}); control loop running, Ctrl-C to stop",
        if att.adopted { "adopted" } else { "attached" },
        att.state.ifindex,
        att.state.egress,
        att.state.xdp_mode
    );
    notify.ready(&match &ud_only {
        None => format!("{iface}: fast path attached, connected mode up"),
        Some(why) => format!("{iface}: fast path attached, every peer on UD ({why})"),
    });
    let looped = run_loop(iface, &mut att, &mut manager, &mut notify, metrics.as_ref()).await;
    notify.stopping(&format!("{iface}: stopping; the fast path stays attached"));
    if let Some(m) = &metrics {
        // Numbers from a loop that no longer runs would mislead: gone, as the loop is.
        let _ = std::fs::remove_file(crate::metrics::textfile_path(&m.dir, iface));
    }
    if let Some(m) = manager
        && let Err(e) = m.shutdown().await
    {
        tracing::warn!("stopping connected mode on {iface}: {e}");
    }
    let detached = looped?;
    finish(iface, detached)
}

/// Connected mode, or None with why not in `ud_only` (when it may fall back).
async fn start_cm(
    iface: &str,
    cm: CmSetup,
    ud_only: &mut Option<String>,
) -> Result<Option<Manager>, DaemonError> {
    match Manager::start(iface, &attach::pin_dir(iface), cm.options).await {
        Ok(m) => Ok(Some(m)),
        Err(e) if !cm.required => {
            tracing::warn!("connected mode unavailable on {iface}, every peer on UD: {e}");
            *ud_only = Some(format!("connected mode unavailable: {e}"));
            Ok(None)
        }
        Err(e) => Err(DaemonError::StartCm(e)),
    }
}

/// The loop proper; true when it ended because the interface was detached.
async fn run_loop(
    iface: &str,
    att: &mut Attached,
    manager: &mut Option<Manager>,
    notify: &mut Notifier,
    metrics: Option<&MetricsOut>,
) -> Result<bool, DaemonError> {
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut metrics_tick = tokio::time::interval(METRICS_EVERY);
    metrics_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut metrics_failed = false;
    let mut slots_tick = tokio::time::interval(SLOTS_EVERY);
    slots_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut slots_short = false;
    let beat = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(beat);
    let mut withheld = false;
    loop {
        tokio::select! {
            _ = int.recv() => return Ok(false),
            _ = term.recv() => return Ok(false),
            _ = &mut beat => {
                if !attach::is_attached(iface) {
                    return Ok(true);
                }
                let next = heartbeat(att, manager.as_mut(), &mut withheld, notify)?;
                beat.as_mut().reset(tokio::time::Instant::now() + next);
            }
            _ = slots_tick.tick() => assign_slots(iface, att, &mut slots_short),
            _ = metrics_tick.tick(), if metrics.is_some() => {
                if let Some(m) = metrics {
                    write_metrics(iface, m, &mut metrics_failed);
                }
            }
            input = next_input(manager) => {
                let Some(m) = manager.as_mut() else { continue };
                if let Err(e) = m.handle(input) {
                    // As when connected mode cannot start: the loop goes on, every peer UD.
                    tracing::error!("connected mode on {iface} stopped on an error: {e}");
                    notify.status(&format!(
                        "{iface}: connected mode stopped on an error, every peer on UD: {e}"
                    ));
                    if let Some(m) = manager.take() {
                        let _ = m.shutdown().await;
                    }
                }
            }
        }
    }
}

/// How often peers the fast path counts apart get a traffic slot.
const SLOTS_EVERY: Duration = Duration::from_secs(1);
/// A UD, unpinned peer silent this long gives its entry and slot back.
const SLOT_IDLE_LIMIT: Duration = Duration::from_secs(600);

/// Gives new peers their traffic slots (see `DatapathMaps::assign_slots`); says once when
/// slots run out and once when they suffice again.
fn assign_slots(iface: &str, att: &mut Attached, short: &mut bool) {
    let idle = SLOT_IDLE_LIMIT.as_nanos() as u64;
    match att.maps.assign_slots(monotonic_ns(), idle) {
        Ok(r) => {
            if r.assigned + r.reclaimed > 0 {
                tracing::debug!("{iface}: traffic slots: {r:?}");
            }
            if (r.waiting > 0) != *short {
                *short = r.waiting > 0;
                if *short {
                    tracing::warn!(
                        "{iface}: every traffic slot is taken ({} peers): {} counted apart \
                         until one is idle for {} s",
                        r.in_use,
                        r.waiting,
                        SLOT_IDLE_LIMIT.as_secs()
                    );
                } else {
                    tracing::info!("{iface}: every peer has a traffic slot again");
                }
            }
        }
        Err(e) => tracing::warn!("{iface}: assigning traffic slots: {e}"),
    }
}

/// Writes the metrics file from what `status` shows now; a failure is logged once (and its
/// end once), the loop goes on.
fn write_metrics(iface: &str, m: &MetricsOut, failed: &mut bool) {
    let written = crate::status::gather(iface)
        .map_err(|e| e.to_string())
        .and_then(|s| {
            let text = crate::metrics::render(&s, m.per_peer);
            crate::metrics::write_textfile(&m.dir, iface, &text).map_err(|e| e.to_string())
        });
    match written {
        Ok(()) if *failed => {
            *failed = false;
            tracing::info!("metrics written again to {}", m.dir.display());
        }
        Ok(()) => {}
        Err(e) if !*failed => {
            *failed = true;
            tracing::warn!("writing metrics to {}: {e}", m.dir.display());
        }
        Err(_) => {}
    }
}

/// The manager's next input; never, without connected mode.
async fn next_input(manager: &mut Option<Manager>) -> crate::connmgr::Input {
    match manager {
        Some(m) => m.next_input().await,
        None => std::future::pending().await,
    }
}

/// Writes the heartbeat, forwards the programs' logs; returns when to beat next: four beats
/// per deadline, at most one a second, at least every 20 ms.
///
/// The heartbeat is what the fast path trusts to redirect to connected mode, so it is
/// withheld while connected mode's engine does not turn (`withheld` remembers, to log the
/// change once): within the heartbeat deadline the fail-safe sends every packet UD. (A wedged
/// runtime stops it anyway: it beats on the same thread.) The service manager's watchdog is
/// fed with the heartbeat, and withheld with it, beating at least thrice per watchdog period.
fn heartbeat(
    att: &mut Attached,
    manager: Option<&mut Manager>,
    withheld: &mut bool,
    notify: &mut Notifier,
) -> Result<Duration, DaemonError> {
    let timeout = att
        .maps
        .policy()
        .map(|p| p.heartbeat_timeout_ns)
        .unwrap_or(ipoib_common::DEFAULT_HEARTBEAT_TIMEOUT_NS);
    let engine_dead = manager.is_some_and(|m| !m.engine_alive());
    if engine_dead != *withheld {
        *withheld = engine_dead;
        if engine_dead {
            tracing::error!("connected mode's engine does not turn: heartbeat withheld");
            notify.status("connected mode's engine does not turn: heartbeat and watchdog withheld");
        } else {
            tracing::info!("heartbeat resumed");
            notify.status("connected mode's engine turns again");
        }
    }
    if !engine_dead {
        att.maps.beat(monotonic_ns())?;
        notify.alive();
    }
    if let Some(dp) = att.datapath.as_mut() {
        dp.flush_logs();
    }
    let next =
        Duration::from_nanos(timeout / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
    Ok(notify.beat_at_most().map_or(next, |w| next.min(w)))
}

fn finish(iface: &str, detached: bool) -> Result<(), DaemonError> {
    if detached || !attach::is_attached(iface) {
        tracing::info!("{iface} was detached; control loop exits");
        return Ok(());
    }
    if let Some(mut s) = attach::read_state(iface) {
        s.loop_pid = None;
        attach::write_state(&s)?;
    }
    tracing::info!(
        "control loop stopped; the datapath stays attached to {iface} and goes UD once the \
         heartbeat is stale (`ipoib-ctl detach {iface}` removes it)"
    );
    Ok(())
}
