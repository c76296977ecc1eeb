//! The control loop of `ipoib-ctl attach`, on one tokio runtime (one thread) per attached
//! interface: the heartbeat is an interval branch, connected mode's [`Manager`] and its
//! engine are branches and tasks of the same runtime, and SIGINT/SIGTERM end it cleanly. A
//! wedged runtime therefore stops the heartbeat too, and the fast path's fail-safe sends
//! every packet UD.

use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};

mod supervisor;

pub use self::supervisor::{Backoff, CmEvent, CmPhase, CmStep, transition};
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

/// A start of connected mode under way (it owns what it borrows).
type Starting = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Manager, CmError>>>>;

/// Connected mode as the loop holds it: the [`CmPhase`] with what each phase owns.
enum CmState {
    /// Every peer on UD for good, and why.
    UdOnly(String),
    Running(Box<Manager>),
    /// It starts again when the backoff says.
    BackingOff,
    Starting(Starting),
}

/// What connected mode has for the loop.
enum CmNext {
    Input(crate::connmgr::Input),
    StartEnded(Box<Result<Manager, CmError>>),
}

impl CmState {
    fn phase(&self) -> CmPhase {
        match self {
            CmState::UdOnly(_) => CmPhase::UdOnly,
            CmState::Running(_) => CmPhase::Running,
            CmState::BackingOff => CmPhase::BackingOff,
            CmState::Starting(_) => CmPhase::Starting,
        }
    }

    fn manager(&mut self) -> Option<&mut Manager> {
        match self {
            CmState::Running(m) => Some(m),
            _ => None,
        }
    }

    /// The running manager's next input, or a start's end; never in the other phases.
    /// Cancel-safe as the manager's inputs are; a start is polled where it stands.
    async fn next(&mut self) -> CmNext {
        match self {
            CmState::Running(m) => CmNext::Input(m.next_input().await),
            CmState::Starting(s) => CmNext::StartEnded(Box::new(s.await)),
            CmState::UdOnly(_) | CmState::BackingOff => std::future::pending().await,
        }
    }
}

/// The control loop of one interface: its fast path's pins and heartbeat, connected mode's
/// state, and what it tells systemd.
struct Daemon<'a> {
    iface: &'a str,
    att: Attached,
    notify: Notifier,
    cm: CmState,
    /// What connected mode starts again with, and when: only once it ran.
    restart: Option<(CmOptions, Backoff)>,
    /// Whether the heartbeat is withheld (the engine does not turn).
    withheld: bool,
    metrics: Option<MetricsOut>,
    metrics_failed: bool,
    slots_short: bool,
}

async fn run_async(
    iface: &str,
    att: Attached,
    cm: Result<CmSetup, String>,
    metrics: Option<MetricsOut>,
) -> Result<(), DaemonError> {
    let options = cm.as_ref().ok().map(|c| c.options.clone());
    let (cm, down) = match cm {
        Ok(cm) => start_cm(iface, cm).await?,
        Err(why) => (CmState::UdOnly(why.clone()), Some(why)),
    };
    // Connected mode that ran once is started again when it stops on an error; one that
    // waits for its port starts once the port is ready.
    let now = std::time::Instant::now();
    let restart = options.and_then(|o| match cm {
        CmState::Running(_) => Some((o, Backoff::new(now))),
        CmState::BackingOff => Some((o, Backoff::waiting_for_port(now))),
        _ => None,
    });
    let mut d = Daemon {
        iface,
        att,
        notify: Notifier::from_env(),
        cm,
        restart,
        withheld: false,
        metrics,
        metrics_failed: false,
        slots_short: false,
    };
    // Only now is this loop running: whoever waits for it (status: loop_pid) finds connected
    // mode set up, and the entries a killed predecessor left CM_UP already reset.
    d.att.state.loop_pid = Some(std::process::id());
    d.att.state.cm_down = down;
    attach::write_state(&d.att.state)?;
    tracing::info!(
        "{} {iface} (ifindex {}, egress {:?}, ingress {:?}); control loop running, Ctrl-C to stop",
        if d.att.adopted { "adopted" } else { "attached" },
        d.att.state.ifindex,
        d.att.state.egress,
        d.att.state.ingress
    );
    let ready = match &d.cm {
        CmState::UdOnly(why) => format!("{iface}: fast path attached, every peer on UD ({why})"),
        _ => format!("{iface}: fast path attached, connected mode up"),
    };
    d.notify.ready(&ready);
    let looped = d.run_loop().await;
    d.shutdown(looped).await
}

/// Connected mode at the loop's start; UD only (said why) when it may fall back; backing off
/// (UD, and started once it is) while its port is not ready, whether it may fall back or not.
async fn start_cm(iface: &str, cm: CmSetup) -> Result<(CmState, Option<String>), DaemonError> {
    match Manager::start(iface, &attach::pin_dir(iface), cm.options).await {
        Ok(m) => Ok((CmState::Running(Box::new(m)), None)),
        Err(e) if e.is_the_ports() => {
            tracing::warn!("connected mode on {iface} waits for its port, every peer on UD: {e}");
            Ok((CmState::BackingOff, Some(format!("waits: {e}"))))
        }
        Err(e) if !cm.required => {
            tracing::warn!("connected mode unavailable on {iface}, every peer on UD: {e}");
            let why = format!("connected mode unavailable: {e}");
            Ok((CmState::UdOnly(why.clone()), Some(why)))
        }
        Err(e) => Err(DaemonError::StartCm(e)),
    }
}

impl Daemon<'_> {
    /// The loop proper; true when it ended because the interface was detached. A restart of
    /// connected mode runs beside the loop's other branches: past its first step (the HCA's
    /// setup, which blocks), the heartbeat, the signals and the metrics go on while it awaits
    /// the TUN device, netlink and the rest.
    async fn run_loop(&mut self) -> Result<bool, DaemonError> {
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut metrics_tick = delayed_interval(METRICS_EVERY);
        let mut slots_tick = delayed_interval(SLOTS_EVERY);
        let beat = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(beat);
        loop {
            tokio::select! {
                _ = int.recv() => return Ok(false),
                _ = term.recv() => return Ok(false),
                _ = &mut beat => {
                    if !attach::is_attached(self.iface) {
                        return Ok(true);
                    }
                    let next = self.heartbeat()?;
                    beat.as_mut().reset(tokio::time::Instant::now() + next);
                }
                _ = slots_tick.tick() => {
                    assign_slots(self.iface, &mut self.att, &mut self.slots_short);
                }
                _ = metrics_tick.tick(), if self.metrics.is_some() => self.write_metrics(),
                next = self.cm.next() => {
                    // Every peer is UD after a stop, and connected mode runs again after a
                    // start: either way the heartbeat says so at once.
                    if self.on_cm(next).await {
                        beat.as_mut().reset(tokio::time::Instant::now());
                    }
                }
                _ = restart_due(self.restart.as_ref().map(|(_, b)| b)),
                    if self.cm.phase() == CmPhase::BackingOff => {
                    let gone = self
                        .restart
                        .as_ref()
                        .is_none_or(|(_, b)| b.remains.as_ref().is_none_or(Remains::gone));
                    self.step(CmEvent::RestartDue { remains_gone: gone }, None).await?;
                }
            }
        }
    }

    /// Connected mode's input or a start's end; true when the heartbeat should beat at once.
    async fn on_cm(&mut self, next: CmNext) -> bool {
        match next {
            CmNext::Input(input) => {
                let Some(m) = self.cm.manager() else {
                    return false;
                };
                let Err(e) = m.on_input(input) else {
                    return false;
                };
                let the_ports = e.is_the_ports();
                if the_ports {
                    tracing::warn!(
                        "{e}: connected mode on {} starts again on the port as it is now, \
                         every peer on UD meanwhile",
                        self.iface
                    );
                } else {
                    tracing::error!("connected mode on {} stopped on an error: {e}", self.iface);
                }
                self.notify.status(&format!(
                    "{}: connected mode stopped, every peer on UD: {e}",
                    self.iface
                ));
                self.say_down(Some(format!("stopped: {e}")));
                let _ = self.step(CmEvent::Stopped { the_ports }, None).await;
                true
            }
            CmNext::StartEnded(started) => {
                let ok = started.is_ok();
                let _ = self.step(CmEvent::StartEnded { ok }, Some(*started)).await;
                true
            }
        }
    }

    /// Moves connected mode on `event` as [`transition`] says, and performs the step.
    async fn step(
        &mut self,
        event: CmEvent,
        started: Option<Result<Manager, CmError>>,
    ) -> Result<(), DaemonError> {
        let (phase, step) = transition(self.cm.phase(), event);
        let now = std::time::Instant::now();
        let iface = self.iface;
        match step {
            CmStep::Ignore => return Ok(()),
            CmStep::StopAndBackOff => {
                let the_ports = matches!(event, CmEvent::Stopped { the_ports: true });
                self.stop_and_back_off(now, the_ports).await;
            }
            CmStep::Postpone => {
                if let Some((_, backoff)) = self.restart.as_mut()
                    && backoff.postpone(now)
                {
                    tracing::warn!(
                        "connected mode on {iface} waits for the last one's tasks to end ({:?} \
                         so far)",
                        Backoff::LINGER_WARN
                    );
                }
            }
            CmStep::BeginStart => self.begin_start()?,
            CmStep::Adopt => {
                if let (Some(Ok(m)), Some((_, backoff))) = (started, self.restart.as_mut()) {
                    backoff.started(now);
                    tracing::info!("connected mode on {iface} runs again");
                    self.notify
                        .status(&format!("{iface}: connected mode up again"));
                    self.cm = CmState::Running(Box::new(m));
                    self.say_down(None);
                }
            }
            CmStep::BackOffAgain => {
                self.cm = CmState::BackingOff;
                if let (Some(Err(e)), Some((_, backoff))) = (started, self.restart.as_mut()) {
                    let wait = if e.is_the_ports() {
                        backoff.port_wait(now)
                    } else {
                        backoff.stopped(now)
                    };
                    // A port that stays down is looked at every second: said at debug level
                    // past the first time.
                    let why = format!("{e}");
                    if self.att.state.cm_down.as_deref() == Some(&*format!("waits: {why}")) {
                        tracing::debug!("connected mode on {iface} still waits: {why}");
                    } else {
                        tracing::warn!(
                            "connected mode on {iface} did not start again: {why}; next try in \
                             {wait:?}"
                        );
                    }
                    self.say_down(Some(format!("waits: {why}")));
                }
            }
        }
        debug_assert_eq!(self.cm.phase(), phase);
        Ok(())
    }

    /// Says in the attach state why connected mode does not run now (None: it runs), for
    /// `status`; written only when it changes. The file is read again first: `set-policy`
    /// writes it too (the budget and the cap), and this loop's copy may be older.
    fn say_down(&mut self, why: Option<String>) {
        if self.att.state.cm_down == why {
            return;
        }
        self.att.state.cm_down = why.clone();
        let mut state = attach::read_state(self.iface).unwrap_or_else(|| self.att.state.clone());
        state.cm_down = why;
        if let Err(e) = attach::write_state(&state) {
            tracing::warn!("{}: writing the attach state: {e}", self.iface);
        }
    }

    /// The running connected mode stopped: shut down, what it leaves kept, the backoff set
    /// (a short one when it was the port's).
    async fn stop_and_back_off(&mut self, now: std::time::Instant, the_ports: bool) {
        let iface = self.iface;
        if let CmState::Running(m) = std::mem::replace(&mut self.cm, CmState::BackingOff) {
            let remains = m.remains();
            let _ = m.shutdown().await;
            if let Some((_, backoff)) = self.restart.as_mut() {
                let wait = if the_ports {
                    backoff.port_wait(now)
                } else {
                    backoff.stopped(now)
                };
                backoff.remains = Some(remains);
                tracing::info!("connected mode on {iface} starts again in {wait:?}");
            }
        }
    }

    /// A start of connected mode again, beside the loop's other branches.
    fn begin_start(&mut self) -> Result<(), DaemonError> {
        // The start's first step, the HCA's setup, holds this thread (0.2-0.4 s on soft-RoCE):
        // a beat just before it bounds the watchdog's wait.
        self.heartbeat()?;
        let Some((options, backoff)) = self.restart.as_mut() else {
            return Ok(());
        };
        backoff.remains = None;
        let iface = self.iface;
        self.notify.status(&format!(
            "{iface}: connected mode starting again, every peer on UD meanwhile"
        ));
        let (name, options) = (iface.to_string(), options.clone());
        self.cm = CmState::Starting(Box::pin(async move {
            Manager::start(&name, &attach::pin_dir(&name), options).await
        }));
        Ok(())
    }

    /// After the loop: a start under way is finished, not dropped halfway (it changes the
    /// interface's GSO and the peers' entries as it goes), then connected mode stopped; the
    /// fast path stays attached.
    async fn shutdown(mut self, looped: Result<bool, DaemonError>) -> Result<(), DaemonError> {
        let iface = self.iface;
        if let CmState::Starting(s) = &mut self.cm {
            self.cm = match s.await {
                Ok(m) => CmState::Running(Box::new(m)),
                Err(_) => CmState::BackingOff,
            };
        }
        self.notify
            .stopping(&format!("{iface}: stopping; the fast path stays attached"));
        if let Some(m) = &self.metrics {
            // Numbers from a loop that no longer runs would mislead: gone, as the loop is.
            let _ = std::fs::remove_file(crate::metrics::textfile_path(&m.dir, iface));
        }
        if let CmState::Running(m) = self.cm
            && let Err(e) = m.shutdown().await
        {
            tracing::warn!("stopping connected mode on {iface}: {e}");
        }
        let detached = looped?;
        finish(iface, detached)
    }

    /// The metrics, made from this process's own state: its maps, its attach state and
    /// connected mode's status as the manager has it.
    fn write_metrics(&mut self) {
        let Some(m) = &self.metrics else {
            return;
        };
        let cm = self.cm.manager().map(|m| m.status());
        let status =
            crate::status::gather_from(self.iface, &self.att.maps, Some(&self.att.state), cm, true);
        write_metrics(self.iface, m, status, &mut self.metrics_failed);
    }

    fn heartbeat(&mut self) -> Result<Duration, DaemonError> {
        heartbeat(
            &mut self.att,
            self.cm.manager(),
            &mut self.withheld,
            &mut self.notify,
        )
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

/// Writes the metrics file from `status` (what `status` would show now); a failure is logged
/// once (and its end once), the loop goes on.
fn write_metrics(
    iface: &str,
    m: &MetricsOut,
    status: Result<crate::status::Status, AttachError>,
    failed: &mut bool,
) {
    let written = status.map_err(|e| e.to_string()).and_then(|s| {
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
        s.cm_down = None;
        attach::write_state(&s)?;
    }
    tracing::info!(
        "control loop stopped; the datapath stays attached to {iface} and goes UD once the \
         heartbeat is stale (`ipoib-ctl detach {iface}` removes it)"
    );
    Ok(())
}
