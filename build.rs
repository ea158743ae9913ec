//! `sqlx::migrate!` (src/startup.rs) embeds `migrations/` when the crate compiles; cargo does
//! not see a file added to that folder by itself, so without this a new migration could be
//! missing from the binary built next (seen: `foundation::migrate_twice_is_harmless` counting
//! 28 applied against 30 files).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
