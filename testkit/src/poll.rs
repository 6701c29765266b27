//! The one polling helper: call `f` until it answers, or time out.

use std::future::Future;
use std::time::Duration;

/// Polls `f` every 100 ms until it returns `Some`, and returns that; panics naming `what` after
/// `timeout`.
pub async fn until<F, Fut, T>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    match poll(timeout, &mut f).await {
        Some(v) => v,
        None => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// Polls `f` every 100 ms until it returns true or `timeout` passes; returns whether it
/// succeeded.
pub async fn wait_for<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll(timeout, || {
        let answer = f();
        async move { answer.await.then_some(()) }
    })
    .await
    .is_some()
}

/// Polls `f` every 100 ms until it returns `Some` (that value) or `timeout` passes (`None`).
pub async fn poll<F, Fut, T>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
