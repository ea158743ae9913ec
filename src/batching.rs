//! The one way work is batched here. Requests queue, each with the slot its answer goes to;
//! a consumer takes the first and then everything queued behind it (up to a bound, waiting a
//! short window for more when asked) as its next batch ([`gather`]); and a request whose slot
//! was dropped unanswered, because the task running its batch died, perhaps after its commit,
//! is answered "unknown", never guessed ([`answer`]). A product's order queue and the
//! combiner of their batches, the refusal claims and the carts are all gathered here.

use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The longest a batch (of orders, or of carts) may take before its
/// requests are told "unknown". The database's own timeouts (lock 10 s, statement 30 s)
/// cannot fire when the link itself goes silent, and a worker stuck on a dead link would
/// stall its product (or every cart) for good.
pub(crate) const BATCH_LIMIT: Duration = Duration::from_secs(12);

/// The batch that begins with `first`: every item queued behind it, while the batch weighs
/// less than `max` (`weight` of each item). With a `window`, it waits that long after the
/// call for more to arrive; without one, it takes only what is queued already.
pub(crate) async fn gather<T>(
    first: T,
    rx: &mut mpsc::UnboundedReceiver<T>,
    max: usize,
    window: Duration,
    weight: impl Fn(&T) -> usize,
) -> Vec<T> {
    let deadline = tokio::time::Instant::now() + window;
    let mut size = weight(&first);
    let mut batch = vec![first];
    while size < max {
        let next = match rx.try_recv() {
            Ok(item) => item,
            Err(_) if window.is_zero() => break,
            Err(_) => match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(item)) => item,
                _ => break,
            },
        };
        size += weight(&next);
        batch.push(next);
    }
    batch
}

/// The answer sent through `slot`; `lost` when its sender was dropped unanswered (the batch's
/// task died holding it, and may have committed).
pub(crate) async fn answer<R>(slot: oneshot::Receiver<R>, lost: R) -> R {
    slot.await.unwrap_or(lost)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(items: &[usize]) -> mpsc::UnboundedReceiver<usize> {
        let (tx, rx) = mpsc::unbounded_channel();
        for i in items {
            tx.send(*i).expect("open");
        }
        rx
    }

    #[tokio::test]
    async fn a_batch_takes_what_is_queued_up_to_its_bound_and_leaves_the_rest() {
        let mut rx = queued(&[2, 3, 4, 5]);
        let batch = gather(1, &mut rx, 3, Duration::ZERO, |_| 1).await;
        assert_eq!(batch, [1, 2, 3]);
        assert_eq!(
            rx.try_recv().ok(),
            Some(4),
            "the rest waits for the next batch"
        );
    }

    #[tokio::test]
    async fn a_batch_is_bounded_by_its_weight() {
        let mut rx = queued(&[600, 600, 1]);
        // 10 + 600 < 1000 takes the next; 1210 is past the bound.
        let batch = gather(10, &mut rx, 1000, Duration::ZERO, |w| *w).await;
        assert_eq!(batch, [10, 600, 600]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_window_waits_for_more_until_it_closes() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let late = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(3)).await;
            late.send(2).expect("open");
            tokio::time::sleep(Duration::from_millis(10)).await;
            late.send(3).expect("open");
        });
        let batch = gather(1, &mut rx, 10, Duration::from_millis(5), |_| 1).await;
        assert_eq!(batch, [1, 2], "2 came within the window, 3 after it");
        drop(tx);
    }

    #[tokio::test]
    async fn without_a_window_nothing_is_waited_for() {
        let (_tx, mut rx) = mpsc::unbounded_channel::<usize>();
        let batch = gather(1, &mut rx, 10, Duration::ZERO, |_| 1).await;
        assert_eq!(batch, [1]);
    }

    #[tokio::test]
    async fn a_slot_dropped_unanswered_is_lost_never_a_guess() {
        let (sent, slot) = oneshot::channel::<Result<u32, &str>>();
        drop(sent);
        assert_eq!(answer(slot, Err("unknown")).await, Err("unknown"));
        let (sent, slot) = oneshot::channel::<Result<u32, &str>>();
        sent.send(Ok(7)).expect("open");
        assert_eq!(answer(slot, Err("unknown")).await, Ok(7));
    }
}
