//! The engine's tasks: one lane on the control loop's thread, or a thread per lane behind one
//! task; how they end, and how they are stopped.

use std::{io, sync::Arc, time::Duration};

use tokio::{
    sync::{mpsc, oneshot, watch},
    task::JoinHandle,
};

use super::{CmError, Resources, Tun};
use crate::engine::{
    Engine, EngineConfig, EngineControl, EngineError, EngineEvent, EngineStats, ud::UdOut,
};

/// The running engine (its lanes') and how to stop it.
pub(super) struct EngineTask {
    pub(super) control: EngineControl,
    /// Each lane's counters.
    pub(super) stats: Vec<Arc<EngineStats>>,
    pub(super) stop: watch::Sender<bool>,
    /// The engine's task; with several lanes, a task that ends when the first lane does and
    /// stops the others. None once it ended.
    pub(super) task: Option<JoinHandle<Result<(), EngineError>>>,
}

/// Why a task ended (the engine's, the listener's: `result` takes its outcome from what it
/// returned): it returned, returned an error, panicked or was aborted. Never, once it was
/// taken.
pub(super) async fn task_end<T, E: std::fmt::Display>(
    task: &mut Option<JoinHandle<T>>,
    result: impl FnOnce(T) -> Result<(), E>,
) -> String {
    let Some(t) = task else {
        return std::future::pending().await;
    };
    match t.await.map(result) {
        Ok(Ok(())) => "it returned".into(),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    }
}

/// Waits for the engine's task to end after its stop; one that does not within a second (a
/// stalled engine) is aborted. Either way the engine, and its TUN device, are dropped.
pub(super) async fn stop_engine(
    mut task: JoinHandle<Result<(), EngineError>>,
) -> Result<(), CmError> {
    match tokio::time::timeout(Duration::from_secs(1), &mut task).await {
        Ok(Ok(r)) => r.map_err(CmError::from),
        Ok(Err(e)) => Err(CmError::Io(io::Error::other(format!(
            "the engine task: {e}"
        )))),
        Err(_) => {
            task.abort();
            let _ = task.await;
            tracing::warn!("the engine did not stop within 1 s: aborted");
            Ok(())
        }
    }
}

/// The engine with its control and events: one lane's as a task of this runtime; several
/// lanes' each on a thread of its own, watched by a task of this runtime that ends when the
/// first lane does (the others are then stopped: connected mode restarts whole).
pub(super) fn spawn_engine(
    mut engines: Vec<Engine>,
) -> (EngineTask, mpsc::UnboundedReceiver<EngineEvent>) {
    let (events_tx, events) = mpsc::unbounded_channel();
    for e in &mut engines {
        e.report_to(events_tx.clone());
    }
    let control = engines[0].control();
    let stats = engines.iter().map(Engine::stats).collect();
    let (stop, stop_rx) = watch::channel(false);
    let task = if engines.len() == 1 {
        let mut engine = engines.remove(0);
        tokio::spawn(async move {
            let r = engine.run(stopped(stop_rx)).await;
            drop(engine);
            r
        })
    } else {
        let stop_all = stop.clone();
        tokio::spawn(async move {
            let mut lanes = tokio::task::JoinSet::new();
            for engine in engines {
                lanes.spawn(on_thread(engine, stop_rx.clone()));
            }
            let first = lanes.join_next().await;
            let _ = stop_all.send(true);
            // The others end on the stop, their engines and TUN queues dropped; one that does
            // not within a second (hung) is left to end with the process.
            let rest = async { while lanes.join_next().await.is_some() {} };
            let _ = tokio::time::timeout(Duration::from_secs(1), rest).await;
            match first {
                Some(Ok(r)) => r,
                Some(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Some(Err(e)) => Err(EngineError::Lane(e.to_string())),
                None => Ok(()),
            }
        })
    };
    let t = EngineTask {
        control,
        stats,
        stop,
        task: Some(task),
    };
    (t, events)
}

/// An engine per lane of `res`, one per TUN queue, each sending over UD out of `iface` what
/// it cannot send over a connection. One lane's on this thread (a node on one lane runs one
/// thread per interface); several lanes' off it, since that gives the device the steering
/// program (loaded the first time: tens of ms on a real CPU, seconds under emulation).
pub(super) async fn make_engines(
    iface: &str,
    queues: Vec<Tun>,
    res: Arc<Resources>,
) -> Result<Vec<Engine>, CmError> {
    let mut engines = if queues.len() == 1 {
        Engine::lanes(queues, res, EngineConfig::default())?
    } else {
        tokio::task::spawn_blocking(move || Engine::lanes(queues, res, EngineConfig::default()))
            .await
            .map_err(|e| CmError::Io(io::Error::other(format!("making the engines: {e}"))))??
    };
    for e in &mut engines {
        match UdOut::new(iface) {
            Ok(out) => e.send_unsent_over(out),
            Err(err) => tracing::warn!(
                "{iface}: no raw socket to UD ({err}): what the engine cannot send over a \
                 connection is dropped"
            ),
        }
    }
    Ok(engines)
}

/// Resolves once `stop` says so (or its sender is gone).
pub(super) async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Runs one lane's engine on a thread of its own until `stop`; its result, or its panic,
/// once it ends.
pub(super) async fn on_thread(
    engine: Engine,
    stop: watch::Receiver<bool>,
) -> Result<(), EngineError> {
    let lane = engine.lane();
    let (tx, rx) = oneshot::channel();
    engine
        .spawn_thread(stopped(stop), move |r| {
            let _ = tx.send(r);
        })
        .map_err(|e| EngineError::Lane(format!("lane {lane}'s thread: {e}")))?;
    match rx.await {
        Ok(r) => r,
        // The thread ended without a word: it panicked (and said so on stderr).
        Err(_) => panic!("the engine of lane {lane} panicked"),
    }
}
