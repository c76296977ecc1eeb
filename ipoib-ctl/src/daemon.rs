//! The control loop of `ipoib-ctl attach`, on one tokio runtime (one thread) per attached
//! interface: the heartbeat is an interval branch, connected mode's [`Manager`] and its
//! engine are branches and tasks of the same runtime, and SIGINT/SIGTERM end it cleanly. A
//! wedged runtime therefore stops the heartbeat too, and the fast path's fail-safe sends
//! every packet UD.

use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};

use crate::{
    attach::{self, AttachError, Attached},
    clock::{delayed_interval, monotonic_ns},
    connmgr::{CmError, CmOptions, Manager, Remains},
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
    let options = cm.as_ref().ok().map(|c| c.options.clone());
    let mut manager = match cm {
        Ok(cm) => start_cm(iface, cm, &mut ud_only).await?,
        Err(why) => {
            ud_only = Some(why);
            None
        }
    };
    // Connected mode that ran once is started again when it stops on an error.
    let mut restart = options
        .filter(|_| manager.is_some())
        .map(|o| (o, Backoff::new(std::time::Instant::now())));
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
    let looped = run_loop(
        iface,
        &mut att,
        &mut manager,
        &mut restart,
        &mut notify,
        metrics.as_ref(),
    )
    .await;
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

/// A start of connected mode under way (it owns what it borrows).
type Starting = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Manager, CmError>>>>;

/// The loop proper; true when it ended because the interface was detached. A restart of
/// connected mode runs beside the loop's other branches: past its first step (the HCA's
/// setup, which blocks), the heartbeat, the signals and the metrics go on while it awaits the
/// TUN device, netlink and the rest.
async fn run_loop(
    iface: &str,
    att: &mut Attached,
    manager: &mut Option<Manager>,
    restart: &mut Option<(CmOptions, Backoff)>,
    notify: &mut Notifier,
    metrics: Option<&MetricsOut>,
) -> Result<bool, DaemonError> {
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut metrics_tick = delayed_interval(METRICS_EVERY);
    let mut metrics_failed = false;
    let mut slots_tick = delayed_interval(SLOTS_EVERY);
    let mut slots_short = false;
    let beat = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(beat);
    let mut withheld = false;
    let mut starting: Option<Starting> = None;
    let ended = loop {
        tokio::select! {
            _ = int.recv() => break Ok(false),
            _ = term.recv() => break Ok(false),
            _ = &mut beat => {
                if !attach::is_attached(iface) {
                    break Ok(true);
                }
                match heartbeat(att, manager.as_mut(), &mut withheld, notify) {
                    Ok(next) => beat.as_mut().reset(tokio::time::Instant::now() + next),
                    Err(e) => break Err(e),
                }
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
                    cm_stopped(iface, e, manager, restart.as_mut().map(|r| &mut r.1), notify)
                        .await;
                    // Every peer is UD now: the heartbeat, withheld if the engine died, is
                    // safe again, and the watchdog has waited long enough.
                    beat.as_mut().reset(tokio::time::Instant::now());
                }
            }
            _ = restart_due(restart.as_ref().map(|(_, b)| b)),
                if manager.is_none() && starting.is_none() => {
                if let Some((options, backoff)) = restart.as_mut() {
                    // The start's first step, the HCA's setup, holds this thread (0.2-0.4 s on
                    // soft-RoCE): a beat just before it bounds the watchdog's wait.
                    match heartbeat(att, None, &mut withheld, notify) {
                        Ok(_) => starting = begin_restart(iface, options, backoff, notify),
                        Err(e) => break Err(e),
                    }
                }
            }
            started = start_done(&mut starting) => {
                starting = None;
                if let Some((_, backoff)) = restart.as_mut() {
                    *manager = restart_done(iface, started, backoff, notify);
                    // The heartbeat says at once that connected mode runs again.
                    beat.as_mut().reset(tokio::time::Instant::now());
                }
            }
        }
    };
    finish_start(starting, manager).await;
    ended
}

/// A start under way when the loop ends is finished, not dropped halfway (it changes the
/// interface's GSO and the peers' entries as it goes): the caller then stops it as any
/// running connected mode.
async fn finish_start(starting: Option<Starting>, manager: &mut Option<Manager>) {
    if let Some(s) = starting
        && let Ok(m) = s.await
    {
        *manager = Some(m);
    }
}

/// What a start under way ends with; never without one.
async fn start_done(starting: &mut Option<Starting>) -> Result<Manager, CmError> {
    match starting {
        Some(s) => s.await,
        None => std::future::pending().await,
    }
}

/// Connected mode stopped on `e`: as when it cannot start, the loop goes on with every peer
/// UD; it starts again after the backoff's wait.
async fn cm_stopped(
    iface: &str,
    e: CmError,
    manager: &mut Option<Manager>,
    backoff: Option<&mut Backoff>,
    notify: &mut Notifier,
) {
    tracing::error!("connected mode on {iface} stopped on an error: {e}");
    notify.status(&format!(
        "{iface}: connected mode stopped on an error, every peer on UD: {e}"
    ));
    if let Some(m) = manager.take() {
        let remains = m.remains();
        let _ = m.shutdown().await;
        if let Some(backoff) = backoff {
            let wait = backoff.stopped(std::time::Instant::now());
            backoff.remains = Some(remains);
            tracing::info!("connected mode on {iface} starts again in {wait:?}");
        }
    }
}

/// The start of connected mode again, due now; None (and the next try set) while what the
/// last one left is not gone.
fn begin_restart(
    iface: &str,
    options: &CmOptions,
    backoff: &mut Backoff,
    notify: &mut Notifier,
) -> Option<Starting> {
    if let Some(r) = backoff.remains.take_if(|r| !r.gone()) {
        backoff.remains = Some(r);
        if backoff.postpone(std::time::Instant::now()) {
            tracing::warn!(
                "connected mode on {iface} waits for the last one's tasks to end ({:?} so \
                 far)",
                Backoff::LINGER_WARN
            );
        }
        return None;
    }
    notify.status(&format!(
        "{iface}: connected mode starting again, every peer on UD meanwhile"
    ));
    let (iface, options) = (iface.to_string(), options.clone());
    Some(Box::pin(async move {
        Manager::start(&iface, &attach::pin_dir(&iface), options).await
    }))
}

/// A start of connected mode again ended: the manager, or None and the next try set.
fn restart_done(
    iface: &str,
    started: Result<Manager, CmError>,
    backoff: &mut Backoff,
    notify: &mut Notifier,
) -> Option<Manager> {
    match started {
        Ok(m) => {
            backoff.started(std::time::Instant::now());
            tracing::info!("connected mode on {iface} runs again");
            notify.status(&format!("{iface}: connected mode up again"));
            Some(m)
        }
        Err(e) => {
            let wait = backoff.stopped(std::time::Instant::now());
            tracing::warn!(
                "connected mode on {iface} did not start again: {e}; next try in {wait:?}"
            );
            None
        }
    }
}

/// When connected mode starts again after it stopped on an error: [`Backoff::FIRST`] after
/// a stop, twice as long after each stop or failed start that came within
/// [`Backoff::STEADY`] of the last start, at most [`Backoff::MOST`]. A stop is worth a
/// restart (a QP, CQ or TUN error on a node that ran connected mode; the engine's panic), a
/// loop of them is not worth a busy node.
#[derive(Debug, Clone)]
pub struct Backoff {
    wait: Duration,
    /// Since when connected mode runs; None while it does not.
    running_since: Option<std::time::Instant>,
    due: Option<std::time::Instant>,
    /// What the connected mode that stopped leaves behind: the next starts once it is gone.
    pub remains: Option<Remains>,
    /// Since when a due start waits for those remains, and whether that was said.
    lingering_since: Option<std::time::Instant>,
    warned: bool,
}

impl Backoff {
    pub const FIRST: Duration = Duration::from_secs(5);
    pub const MOST: Duration = Duration::from_secs(300);
    pub const STEADY: Duration = Duration::from_secs(600);
    /// How often a due start looks again whether the last one's remains are gone.
    pub const LINGER: Duration = Duration::from_millis(500);
    pub const LINGER_WARN: Duration = Duration::from_secs(30);

    /// Connected mode started at `now`.
    pub fn new(now: std::time::Instant) -> Self {
        Self {
            wait: Duration::ZERO,
            running_since: Some(now),
            due: None,
            remains: None,
            lingering_since: None,
            warned: false,
        }
    }

    /// The start due at `now` waits [`Backoff::LINGER`] more: what the last connected mode
    /// left is not gone. True once, when the waiting has gone on for
    /// [`Backoff::LINGER_WARN`] (a task that never ends keeps connected mode off).
    pub fn postpone(&mut self, now: std::time::Instant) -> bool {
        let since = *self.lingering_since.get_or_insert(now);
        self.due = Some(now + Self::LINGER);
        let long = now.duration_since(since) >= Self::LINGER_WARN;
        long && !std::mem::replace(&mut self.warned, true)
    }

    pub fn started(&mut self, now: std::time::Instant) {
        self.running_since = Some(now);
        self.due = None;
        self.lingering_since = None;
        self.warned = false;
    }

    /// Connected mode stopped, or did not start, at `now`: how long until the next start.
    pub fn stopped(&mut self, now: std::time::Instant) -> Duration {
        let steady = self
            .running_since
            .take()
            .is_some_and(|t| now.duration_since(t) >= Self::STEADY);
        self.wait = if self.wait.is_zero() || steady {
            Self::FIRST
        } else {
            (self.wait * 2).min(Self::MOST)
        };
        self.due = Some(now + self.wait);
        self.lingering_since = None;
        self.warned = false;
        self.wait
    }

    /// When connected mode should start again; None while it runs.
    pub fn due(&self) -> Option<std::time::Instant> {
        self.due
    }
}

/// Resolves when a restart of connected mode is due; never without one.
async fn restart_due(backoff: Option<&Backoff>) {
    match backoff.and_then(Backoff::due) {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_restart_waits_longer_after_each_quick_stop_and_short_again_after_a_steady_run() {
        let t0 = Instant::now();
        let mut b = Backoff::new(t0);
        assert_eq!(b.due(), None, "nothing due while it runs");
        // Stopped after a minute: the first wait.
        let t = t0 + 60 * S;
        assert_eq!(b.stopped(t), Backoff::FIRST);
        assert_eq!(b.due(), Some(t + Backoff::FIRST));
        // The start fails: twice as long, and twice again.
        let t = t + Backoff::FIRST;
        assert_eq!(b.stopped(t), 2 * Backoff::FIRST);
        let t = t + 2 * Backoff::FIRST;
        assert_eq!(b.stopped(t), 4 * Backoff::FIRST);
        // It starts, and stops again soon: the wait goes on growing, up to the most.
        let t = t + 4 * Backoff::FIRST;
        b.started(t);
        assert_eq!(b.due(), None);
        assert_eq!(b.stopped(t + S), 8 * Backoff::FIRST);
        for _ in 0..10 {
            b.stopped(t + S);
        }
        assert_eq!(b.stopped(t + S), Backoff::MOST);
        // Failed starts long after the last run do not count as a steady run.
        assert_eq!(b.stopped(t + 2 * Backoff::STEADY), Backoff::MOST);
        // A run as long as STEADY: the next stop waits the first wait again.
        let t = t + 3 * Backoff::STEADY;
        b.started(t);
        assert_eq!(b.stopped(t + Backoff::STEADY), Backoff::FIRST);
        assert_eq!(b.due(), Some(t + Backoff::STEADY + Backoff::FIRST));
    }

    #[test]
    fn a_start_waits_for_the_last_ones_remains_and_says_so_once_when_long() {
        let t0 = Instant::now();
        let mut b = Backoff::new(t0);
        let t = t0 + S;
        b.stopped(t);
        let due = t + Backoff::FIRST;
        assert!(!b.postpone(due));
        assert_eq!(b.due(), Some(due + Backoff::LINGER));
        let mut said = 0;
        let mut now = due;
        while now < due + 2 * Backoff::LINGER_WARN {
            now += Backoff::LINGER;
            said += usize::from(b.postpone(now));
            assert_eq!(b.due(), Some(now + Backoff::LINGER));
            if now < due + Backoff::LINGER_WARN {
                assert_eq!(said, 0, "said after {:?}", now - due);
            }
        }
        assert_eq!(said, 1);
        // Started at last, and stopped again: a new wait is said anew.
        b.started(now);
        b.stopped(now + S);
        let due = b.due().unwrap();
        assert!(!b.postpone(due));
        assert!(b.postpone(due + Backoff::LINGER_WARN));
    }
}
