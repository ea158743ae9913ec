//! What each buyer does, drawn from its own stream of the run's seed: which products its
//! cart names, how long it pays, and how it ends its hold.

/// Buyer `b`'s own random stream (cart, payment delay, ending), so workers need not share
/// one and a run replays from --seed (with the same `fastrand` as in Cargo.lock).
pub(super) fn buyer_rng(seed: u64, b: u64) -> fastrand::Rng {
    fastrand::Rng::with_seed(seed ^ b.wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// `lines` distinct product indexes below `products` (the service refuses a cart naming a
/// product twice). Needs `lines <= products`.
pub(super) fn pick_cart(rng: &mut fastrand::Rng, products: usize, lines: usize) -> Vec<usize> {
    let mut cart = Vec::with_capacity(lines);
    while cart.len() < lines {
        let p = rng.usize(..products);
        if !cart.contains(&p) {
            cart.push(p);
        }
    }
    cart
}

/// How a buyer ends its hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    Confirm,
    Release,
    WalkAway,
}

/// `abandon_roll` below `abandon` abandons; of those, `release_roll` below `release_share`
/// releases and the rest walk away.
pub(super) fn ending(
    abandon_roll: f64,
    release_roll: f64,
    abandon: f64,
    release_share: f64,
) -> Ending {
    if abandon_roll >= abandon {
        Ending::Confirm
    } else if release_roll < release_share {
        Ending::Release
    } else {
        Ending::WalkAway
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endings_split_by_the_abandon_and_release_shares() {
        assert_eq!(ending(0.5, 0.0, 0.2, 0.5), Ending::Confirm);
        assert_eq!(ending(0.19, 0.49, 0.2, 0.5), Ending::Release);
        assert_eq!(ending(0.19, 0.5, 0.2, 0.5), Ending::WalkAway);
        // No abandon at all: everyone confirms, whatever the rolls.
        assert_eq!(ending(0.0, 0.0, 0.0, 1.0), Ending::Confirm);
        // Over many buyers the shares come out near what was asked.
        let mut rng = buyer_rng(7, 0);
        let mut seen = [0u32; 3];
        for _ in 0..10_000 {
            match ending(rng.f64(), rng.f64(), 0.2, 0.5) {
                Ending::Confirm => seen[0] += 1,
                Ending::Release => seen[1] += 1,
                Ending::WalkAway => seen[2] += 1,
            }
        }
        assert!((7_700..=8_300).contains(&seen[0]), "{seen:?}");
        assert!((800..=1_200).contains(&seen[1]), "{seen:?}");
        assert!((800..=1_200).contains(&seen[2]), "{seen:?}");
    }

    #[test]
    fn carts_name_distinct_products_and_delays_stay_in_range() {
        for b in 0..1_000 {
            let mut rng = buyer_rng(42, b);
            let mut cart = pick_cart(&mut rng, 3, 3);
            cart.sort_unstable();
            assert_eq!(cart, vec![0, 1, 2], "buyer {b}");
            let d = rng.u64(5..=9);
            assert!((5..=9).contains(&d), "buyer {b}: {d}");
        }
    }

    #[test]
    fn a_seed_replays_every_buyers_cart_delay_and_ending() {
        let draw = |seed, b| {
            let mut rng = buyer_rng(seed, b);
            let cart = pick_cart(&mut rng, 20, 3);
            (
                cart,
                rng.u64(0..=200),
                ending(rng.f64(), rng.f64(), 0.2, 0.5),
            )
        };
        for b in 0..100 {
            assert_eq!(draw(42, b), draw(42, b), "buyer {b}");
        }
        // Buyers draw apart from each other, and another seed draws another run.
        assert_ne!(
            (0..20).map(|b| draw(42, b)).collect::<Vec<_>>(),
            (20..40).map(|b| draw(42, b)).collect::<Vec<_>>()
        );
        assert_ne!(
            (0..20).map(|b| draw(42, b)).collect::<Vec<_>>(),
            (0..20).map(|b| draw(43, b)).collect::<Vec<_>>()
        );
    }
}
