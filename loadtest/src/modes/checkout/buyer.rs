//! One buyer: hold a cart, pay, then confirm, release or walk away; each step retried until
//! its outcome is known, and every answer counted in the worker's tally.

use super::Plan;
use super::tally::{Step, Tally};
use super::workload::{Ending, buyer_rng, ending, pick_cart};
use crate::client::{Answer, error_code, error_label};
use crate::samples::Allocation;
use chrono::{DateTime, Utc};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Attempts per step: a 503 with Retry-After or a lost answer is retried (holds by their
/// Idempotency-Key, confirm and release by the hold id), so each outcome becomes known.
pub(super) const ATTEMPTS: u32 = 5;

#[derive(Deserialize)]
struct HoldBody {
    hold_id: String,
    status: String,
    expires_at: DateTime<Utc>,
}

#[derive(Deserialize)]
struct OrderBody {
    status: String,
    lines: Vec<LineBody>,
    /// Where its units came from (a hold's confirm keeps the hold's).
    #[serde(default)]
    allocations: Vec<Allocation>,
}

#[derive(Deserialize)]
struct LineBody {
    product_id: String,
    quantity: u64,
}

/// Sends one step, retrying 503-with-Retry-After and lost answers (every step here is
/// safe to repeat); `None` when no answer came after [`ATTEMPTS`] (counted unresolved).
/// A 503 without Retry-After is outside the contract and returned for the caller to flag.
async fn send(
    plan: &Plan,
    t: &mut Tally,
    step: Step,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> Option<Answer> {
    for attempt in 1..=ATTEMPTS {
        let sent = Instant::now();
        let answer = plan
            .api
            .admin_call(method.clone(), path, key, body, plan.deadline)
            .await;
        let us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
        let h = match step {
            Step::Hold => &mut t.hold,
            Step::Confirm => &mut t.confirm,
            Step::Release => &mut t.release,
        };
        h.saturating_record(us.max(1));
        t.last_answer = t.last_answer.max(Some(Instant::now()));
        let wait = match answer {
            Ok(a) if a.status == StatusCode::SERVICE_UNAVAILABLE && a.retry_after.is_some() => {
                let label = format!("{}: {}", step.name(), error_label(a.status, &a.body));
                *t.retried.entry(label).or_default() += 1;
                // Honour the service's hint, but a load run should not stall for long.
                a.retry_after
                    .unwrap_or_default()
                    .min(Duration::from_secs(1))
            }
            Ok(a) => return Some(a),
            Err(label) => {
                *t.retried
                    .entry(format!("{}: {label}", step.name()))
                    .or_default() += 1;
                Duration::from_millis(50)
            }
        };
        if attempt == ATTEMPTS || Instant::now() + wait >= plan.deadline {
            break;
        }
        tokio::time::sleep(wait).await;
    }
    t.counts.unresolved += 1;
    None
}

/// One buyer: hold a cart, pay, then confirm, release or walk away.
pub(super) async fn buyer(plan: &Plan, t: &mut Tally, b: u64) {
    let a = &plan.a;
    t.started += 1;
    let mut rng = buyer_rng(plan.seed, b);
    let cart = pick_cart(&mut rng, plan.products.len(), a.lines as usize);
    let Some(hold) = take_hold(plan, t, b, &cart).await else {
        return;
    };
    t.counts.holds_taken += 1;
    let delay = rng.u64(a.delay_min_ms..=a.delay_max_ms);
    let plan_end = ending(rng.f64(), rng.f64(), a.abandon, a.release_share);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    end_hold(plan, t, &hold, plan_end, &cart).await;
}

/// Asks to hold buyer `b`'s cart; `Some` when the units are held, otherwise the answer is
/// counted (refused, unexpected or unresolved).
async fn take_hold(plan: &Plan, t: &mut Tally, b: u64, cart: &[usize]) -> Option<HoldBody> {
    let qty = plan.a.qty;
    let lines: Vec<Value> = cart
        .iter()
        .map(|&p| json!({"product_id": plan.products[p], "quantity": qty}))
        .collect();
    let body =
        json!({"user_id": format!("lt-{}-{b}", plan.tag), "lines": lines, "ttl_s": plan.a.ttl_s});
    let key = format!("lt-{}-hold-{b}", plan.tag);
    let path = "/v1/holds";
    let ans = send(
        plan,
        t,
        Step::Hold,
        Method::POST,
        path,
        Some(&key),
        Some(&body),
    )
    .await?;
    let unexpected = match ans.status {
        StatusCode::CREATED => match serde_json::from_slice::<HoldBody>(&ans.body) {
            Ok(h) if h.status == "held" => return Some(h),
            Ok(h) => format!("201 status {}", h.status),
            Err(_) => "201 unreadable body".into(),
        },
        StatusCode::CONFLICT if error_code(&ans.body).as_deref() == Some("OUT_OF_STOCK") => {
            t.counts.holds_refused += 1;
            return None;
        }
        s => error_label(s, &ans.body),
    };
    t.unexpected(Step::Hold, unexpected);
    None
}

/// Ends a hold the way the buyer planned; whatever comes back, the hold is over by its
/// expiry at the latest.
async fn end_hold(plan: &Plan, t: &mut Tally, hold: &HoldBody, end: Ending, cart: &[usize]) {
    let path = format!("/v1/holds/{}", hold.hold_id);
    match end {
        Ending::WalkAway => {
            t.counts.abandoned += 1;
            t.ended(hold.expires_at);
        }
        Ending::Confirm => {
            let path = format!("{path}/confirm");
            let ans = send(plan, t, Step::Confirm, Method::POST, &path, None, None).await;
            t.ended(hold.expires_at);
            if let Some(ans) = ans {
                let held = cart.iter().map(|&p| (p, u64::from(plan.a.qty))).collect();
                confirmed(plan, t, &ans, held);
            }
        }
        Ending::Release => {
            let ans = send(plan, t, Step::Release, Method::DELETE, &path, None, None).await;
            t.ended(hold.expires_at);
            if let Some(ans) = ans {
                released(t, &ans);
            }
        }
    }
}

/// Classifies a confirm answer. The units counted are the order's own lines (the service's
/// word), and they must be the held ones: an order that differs from its hold is flagged.
fn confirmed(plan: &Plan, t: &mut Tally, ans: &Answer, mut held: Vec<(usize, u64)>) {
    match ans.status {
        StatusCode::CREATED | StatusCode::OK => {
            match serde_json::from_slice::<OrderBody>(&ans.body) {
                Ok(o) if o.status == "confirmed" => {
                    t.counts.confirmed += 1;
                    let mut got = Vec::with_capacity(o.lines.len());
                    for l in o.lines {
                        match plan.index.get(&l.product_id) {
                            Some(&i) => {
                                t.units[i] += l.quantity;
                                got.push((i, l.quantity));
                            }
                            None => got.push((usize::MAX, l.quantity)),
                        }
                    }
                    t.allocate(&plan.index, &o.allocations);
                    got.sort_unstable();
                    held.sort_unstable();
                    if got != held {
                        t.unexpected(Step::Confirm, "order lines differ from the hold's".into());
                    }
                }
                Ok(o) => t.unexpected(
                    Step::Confirm,
                    format!("{} status {}", ans.status.as_u16(), o.status),
                ),
                Err(_) => t.unexpected(
                    Step::Confirm,
                    format!("{} unreadable body", ans.status.as_u16()),
                ),
            }
        }
        StatusCode::CONFLICT if error_code(&ans.body).as_deref() == Some("HOLD_EXPIRED") => {
            t.counts.confirm_too_late += 1;
        }
        s => t.unexpected(Step::Confirm, error_label(s, &ans.body)),
    }
}

fn released(t: &mut Tally, ans: &Answer) {
    if ans.status != StatusCode::OK {
        return t.unexpected(Step::Release, error_label(ans.status, &ans.body));
    }
    match serde_json::from_slice::<HoldBody>(&ans.body) {
        Ok(h) if h.status == "released" => t.counts.released += 1,
        Ok(h) if h.status == "expired" => t.counts.release_after_expiry += 1,
        Ok(h) => t.unexpected(Step::Release, format!("200 status {}", h.status)),
        Err(_) => t.unexpected(Step::Release, "200 unreadable body".into()),
    }
}
