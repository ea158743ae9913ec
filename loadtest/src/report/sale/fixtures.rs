//! Made-up samples and runs for the tests of the sale report and its HTML page.

use crate::samples::{
    AvailAnswer, AvailSample, Clock, FinalRead, OrderOutcome, OrderSample, SaleRun, SaleSpec,
};

/// An order of its own buyer (one order per buyer, as without attempts).
pub(in crate::report) fn order(recv_us: u64, outcome: OrderOutcome) -> OrderSample {
    buyer_order(recv_us, recv_us, outcome)
}

pub(in crate::report) fn buyer_order(
    buyer: u64,
    recv_us: u64,
    outcome: OrderOutcome,
) -> OrderSample {
    OrderSample {
        buyer,
        sent_us: recv_us.saturating_sub(1_000),
        recv_us,
        outcome,
    }
}

pub(in crate::report) fn confirmed(recv_us: u64) -> OrderSample {
    order(recv_us, OrderOutcome::Confirmed { quantity: 1 })
}

pub(in crate::report) fn answer(recv_us: u64, available: bool, as_of_us: i64) -> AvailSample {
    AvailSample {
        sent_us: recv_us.saturating_sub(500),
        recv_us,
        outcome: Ok(AvailAnswer {
            available,
            available_quantity: i64::from(available),
            as_of_us,
            stale_by_ms: 0,
            served_by: "replica-1".into(),
        }),
    }
}

pub(in crate::report) fn run(
    orders: Vec<OrderSample>,
    avail: Vec<AvailSample>,
    final_qty: i64,
) -> SaleRun {
    SaleRun {
        spec: SaleSpec {
            mode: "flash-sale",
            base_url: "http://127.0.0.1:1".into(),
            product_id: "p".into(),
            stock: 2,
            buyers: orders.len() as u64,
            attempts_per_buyer: 1,
            max_per_customer: None,
            concurrency: 2,
            qty: 1,
            pollers: 1,
            locations: Vec::new(),
        },
        clock: Clock::start(),
        product_visible_after_ms: 0,
        orders,
        allocated: Default::default(),
        avail,
        not_sent: 0,
        avail_capped: false,
        final_read: Ok(FinalRead {
            available_quantity: final_qty,
            served_by: "primary".into(),
            as_of: "2026-01-01T00:00:00.000Z".into(),
            covers_all_orders: true,
            waited_ms: 0,
            levels: Vec::new(),
        }),
        replicas_before: None,
        replicas_after: None,
    }
}

pub(in crate::report) fn limited(limit: u32, already: u32) -> OrderOutcome {
    OrderOutcome::LimitExceeded { limit, already }
}

pub(in crate::report) fn limited_run(
    orders: Vec<OrderSample>,
    stock: u32,
    limit: u32,
    final_qty: i64,
) -> SaleRun {
    let mut r = run(orders, Vec::new(), final_qty);
    r.spec.stock = stock;
    r.spec.buyers = 2;
    r.spec.attempts_per_buyer = 3;
    r.spec.max_per_customer = Some(limit);
    r.spec.pollers = 0;
    r
}
