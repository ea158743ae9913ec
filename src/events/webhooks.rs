//! Webhooks: each gets every event of its types, in feed order, signed, at least once.
