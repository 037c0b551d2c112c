//! The one thread that owns the SQLite connection. Calls queue in order; lease renewals go in a
//! lane of their own that the thread serves first, so a node that is busy publishing (a
//! transaction and an fsync per checkpoint, dozens of workspaces at once) still renews its
//! leases within one transaction's time instead of waiting behind the whole queue. A starved
//! renewal is not slow but harmful: the volumes refuse writes when the lease runs out.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use rusqlite::Connection;

use crate::{CatalogError, Result};

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lane {
    /// Served first: lease renewals.
    Urgent,
    Normal,
}

#[derive(Default)]
struct Jobs {
    urgent: VecDeque<Job>,
    normal: VecDeque<Job>,
    closed: bool,
}

/// The queue the catalog's handles push to; closed (and the thread ends, dropping the
/// connection after the jobs already queued) when the catalog is dropped.
pub(super) struct Worker {
    jobs: Arc<(Mutex<Jobs>, Condvar)>,
}

fn lock(m: &Mutex<Jobs>) -> MutexGuard<'_, Jobs> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Worker {
    pub(super) fn start(mut conn: Connection) -> std::io::Result<Worker> {
        let jobs: Arc<(Mutex<Jobs>, Condvar)> = Arc::default();
        let q = jobs.clone();
        std::thread::Builder::new()
            .name("strata-sqlite".into())
            .spawn(move || loop {
                let job = {
                    let (m, cv) = &*q;
                    let mut j = lock(m);
                    loop {
                        if let Some(job) = j.urgent.pop_front().or_else(|| j.normal.pop_front()) {
                            break job;
                        }
                        if j.closed {
                            return;
                        }
                        j = cv.wait(j).unwrap_or_else(|p| p.into_inner());
                    }
                };
                job(&mut conn);
            })?;
        Ok(Worker { jobs })
    }

    /// Runs `f` on the connection in the worker's thread. Dropping the returned future does
    /// not cancel a queued call (it runs, and its result is discarded), as with a blocking task.
    pub(super) async fn run<T, F>(&self, lane: Lane, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |c| {
            let r = catch_unwind(AssertUnwindSafe(|| f(c)))
                .unwrap_or_else(|_| Err(CatalogError::backend("catalog call panicked")));
            let _ = tx.send(r);
        });
        {
            let (m, cv) = &*self.jobs;
            let mut j = lock(m);
            match lane {
                Lane::Urgent => j.urgent.push_back(job),
                Lane::Normal => j.normal.push_back(job),
            }
            cv.notify_one();
        }
        rx.await
            .map_err(|_| CatalogError::backend("catalog thread stopped"))?
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let (m, cv) = &*self.jobs;
        lock(m).closed = true;
        cv.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The urgent lane overtakes a queue of normal calls: with the thread held busy by one
    /// call and 50 more queued behind it, a renewal queued last runs second.
    #[tokio::test]
    async fn urgent_calls_overtake_the_queue() {
        let w = Arc::new(Worker::start(Connection::open_in_memory().unwrap()).unwrap());
        let order = Arc::new(Mutex::new(Vec::new()));
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        let first = tokio::spawn({
            let w = w.clone();
            let order = order.clone();
            async move {
                w.run(Lane::Normal, move |_| {
                    started_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                    order.lock().unwrap().push("first".to_string());
                    Ok(())
                })
                .await
            }
        });
        started_rx.await.unwrap();
        let mut rest = Vec::new();
        for i in 0..50 {
            let (w, order) = (w.clone(), order.clone());
            rest.push(tokio::spawn(async move {
                w.run(Lane::Normal, move |_| {
                    order.lock().unwrap().push(format!("n{i}"));
                    Ok(())
                })
                .await
            }));
        }
        while w.jobs.0.lock().unwrap().normal.len() < 50 {
            tokio::task::yield_now().await;
        }
        let urgent = tokio::spawn({
            let (w, order) = (w.clone(), order.clone());
            async move {
                w.run(Lane::Urgent, move |_| {
                    order.lock().unwrap().push("urgent".to_string());
                    Ok(())
                })
                .await
            }
        });
        while w.jobs.0.lock().unwrap().urgent.is_empty() {
            tokio::task::yield_now().await;
        }
        go_tx.send(()).unwrap();
        first.await.unwrap().unwrap();
        urgent.await.unwrap().unwrap();
        for r in rest {
            r.await.unwrap().unwrap();
        }
        let order = order.lock().unwrap();
        assert_eq!(order.len(), 52);
        assert_eq!(order[0], "first");
        assert_eq!(order[1], "urgent", "{order:?}");
        assert_eq!(order[2], "n0");
    }

    #[tokio::test]
    async fn a_panicking_call_is_an_error_and_the_thread_goes_on() {
        let w = Worker::start(Connection::open_in_memory().unwrap()).unwrap();
        let r: Result<()> = w.run(Lane::Normal, |_| panic!("boom")).await;
        assert!(matches!(r, Err(CatalogError::Backend { .. })));
        let v: i64 = w
            .run(Lane::Normal, |c| {
                c.query_row("SELECT 41 + 1", [], |r| r.get(0))
                    .map_err(|e| CatalogError::from_source("sqlite", false, e))
            })
            .await
            .unwrap();
        assert_eq!(v, 42);
    }
}
