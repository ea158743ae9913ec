//! Where a single-product order is placed, as a value: here, or at its product's owner.
//!
//! [`decide`] is the one place that makes the choice, from three things: whether the product
//! is contended on this instance ([`crate::checkout::Checkout::contended`]), the rendezvous
//! rank of every peer for the product ([`rank`]), and which peers are passed over for now
//! (the client's down list). A product that is not contended is placed here, since only a row
//! another writer keeps taking is worth a hop. A contended one goes to the live peer that
//! ranks it highest; this instance always counts as live, so it places the order itself when
//! it ranks highest, or when every peer above it is down. Every instance ranks with the same
//! keys over the same list, so all of them name the same owner, and losing a peer moves only
//! its own products.
//!
//! Carts, holds, cancels and reads never ask: they are placed where they arrive.

use std::fmt;
use std::hash::{Hash, Hasher};

/// Where a single-product order is placed. Made only by [`decide`]; the handler acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement<'a> {
    /// By this instance's own batches.
    Here,
    /// By this peer (its URL in `STOCKGATE_PEERS`), whose answer is the client's answer.
    Owner(&'a str),
}

impl fmt::Display for Placement<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Here => f.write_str("here"),
            Placement::Owner(peer) => write!(f, "owner {peer}"),
        }
    }
}

/// Where an order for `product` is placed by `me`, one of `all`, when `is_down` names the
/// peers passed over for now (`me` is never passed over).
pub fn decide<'a>(
    product: &str,
    contended: bool,
    me: &str,
    all: &'a [String],
    is_down: impl Fn(&str) -> bool,
) -> Placement<'a> {
    if !contended {
        return Placement::Here;
    }
    let owner = all
        .iter()
        .filter(|p| *p == me || !is_down(p))
        .max_by_key(|p| rank(p, product));
    match owner {
        Some(owner) if owner != me => Placement::Owner(owner),
        _ => Placement::Here,
    }
}

/// Rendezvous rank of `peer` for `product`: every instance computes the same owner from the
/// same list, and removing a peer moves only its own products.
fn rank(peer: &str, product: &str) -> u64 {
    // SipHash with fixed keys: the same on every instance and build.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new_with_keys(0x7374_6f63_6b67_6174, 0x6f77_6e65_7273);
    peer.hash(&mut h);
    product.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "http://a:9000";
    const B: &str = "http://b:9000";
    const C: &str = "http://c:9000";

    /// A product whose rank order over A, B, C is pinned below.
    const PRODUCT: &str = "flash-60";

    fn all() -> Vec<String> {
        [A, B, C].map(String::from).to_vec()
    }

    /// Every instance of a deployment, whatever build it runs, must rank alike, or two of them
    /// name different owners (they would only contend, but the hop would buy nothing). A
    /// change of hasher or keys fails here. Mutation seen to fail it: the second key changed.
    #[test]
    fn the_rendezvous_order_is_the_same_on_every_build() {
        let mut order = [A, B, C];
        order.sort_by_key(|p| std::cmp::Reverse(rank(p, PRODUCT)));
        assert_eq!(order, [B, A, C]);
    }

    /// The decision's table: contended or not, who asks, who is down, for [`PRODUCT`], whose
    /// peers rank B, then A, then C. Mutations seen to fail it: the contention check deleted
    /// (row 1); `me` passed over like the others when down (row 7); the lowest rank taken
    /// (row 2).
    #[test]
    fn a_contended_product_goes_to_its_highest_ranked_live_peer_unless_that_is_this_one() {
        let here = Placement::Here;
        let owner = Placement::Owner;
        #[rustfmt::skip]
        let table: [(bool, &str, &[&str], Placement); 9] = [
            // contended, me, down, placement
            (false, A, &[],     here),     // not contended: never leaves
            (true,  A, &[],     owner(B)), // B ranks highest
            (true,  C, &[],     owner(B)), // every instance names the same owner
            (true,  B, &[],     here),     // the owner places its own
            (true,  C, &[B],    owner(A)), // the next live rank
            (true,  A, &[B],    here),     // next in rank is this one
            (true,  B, &[B],    here),     // this instance never counts as down
            (true,  C, &[B, A], here),     // every other peer down
            (true,  C, &[A],    owner(B)), // one down below the owner changes nothing
        ];
        let all = all();
        for (i, (contended, me, down, want)) in table.into_iter().enumerate() {
            let got = decide(PRODUCT, contended, me, &all, |p| down.contains(&p));
            assert_eq!(
                got,
                want,
                "row {}: contended {contended}, {me}, down {down:?}",
                i + 1
            );
        }
    }

    #[test]
    fn a_peer_list_of_one_places_everything_here() {
        let me = [A.to_string()];
        assert_eq!(decide(PRODUCT, true, A, &me, |_| false), Placement::Here);
    }

    #[test]
    fn a_placement_reads_as_where_the_order_goes() {
        assert_eq!(Placement::Here.to_string(), "here");
        assert_eq!(Placement::Owner(B).to_string(), "owner http://b:9000");
    }
}
