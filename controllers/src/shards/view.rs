//! Views and rendezvous hashing: who owns which tenant, and the leadership handed to the
//! runtimes; Lease names.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

/// Which replicas are live, as this replica sees them, and whether they all agree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    /// Stable hash of the sorted live replicas and their incarnations; a fenced view has an id
    /// of its own (per fence), so acknowledging it says the manager saw that fence.
    pub id: u64,
    /// Sorted live identities, including this replica once its Lease is written.
    pub replicas: Arc<[String]>,
    pub me: String,
    /// Every live replica's Lease acknowledges `id`.
    pub settled: bool,
    /// This replica cannot prove its own Lease is current, or its manager or watch is stuck: it
    /// owns nothing.
    pub fenced: bool,
}

impl View {
    /// No sharding (one replica): owns everything.
    pub fn single(me: &str) -> View {
        View {
            id: view_id([(me, None)]),
            replicas: Arc::from([me.to_owned()]),
            me: me.to_owned(),
            settled: true,
            fenced: false,
        }
    }

    /// The replica with the highest rendezvous weight for `tenant` (ties to the greater name,
    /// which cannot happen between distinct replicas in practice but keeps the choice total).
    pub fn owner(&self, tenant: &str) -> Option<&str> {
        self.replicas
            .iter()
            .max_by_key(|replica| (weight(replica, tenant), replica.as_str()))
            .map(String::as_str)
    }

    pub fn owns(&self, tenant: &str) -> bool {
        !self.fenced && self.owner(tenant) == Some(self.me.as_str())
    }
}

/// The leadership of this replica's tenant runtimes. It is handed out here so that fencing can
/// take it from every runtime at once, whatever the manager is doing (it may be what is stuck).
/// Cheap to clone; the default is never taken away (one replica, no sharing).
#[derive(Clone, Debug, Default)]
pub struct Leadership {
    pub(super) grants: Arc<Mutex<Grants>>,
}

#[derive(Debug, Default)]
pub(super) struct Grants {
    /// Fenced: new runtimes do not lead.
    pub(super) revoked: bool,
    /// The runtimes leading now (ended or stopped ones are pruned as new ones come).
    pub(super) leading: Vec<watch::Sender<bool>>,
}

impl Leadership {
    pub(super) fn lock(&self) -> MutexGuard<'_, Grants> {
        self.grants.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A runtime's leadership: leading unless this replica is fenced now, and taken away for good
    /// if it is fenced later (the runtime must be started again to lead again). The caller keeps
    /// the sender to take it away itself when it stops the runtime.
    pub fn grant(&self) -> (watch::Sender<bool>, watch::Receiver<bool>) {
        let mut grants = self.lock();
        let (sender, receiver) = watch::channel(!grants.revoked);
        if !grants.revoked {
            grants
                .leading
                .retain(|leading| leading.receiver_count() > 0 && *leading.borrow());
            grants.leading.push(sender.clone());
        }
        (sender, receiver)
    }

    /// Fenced: takes the leadership of every runtime away; returns how many still led.
    pub(super) fn revoke(&self) -> usize {
        let mut grants = self.lock();
        grants.revoked = true;
        grants
            .leading
            .drain(..)
            .filter(|leading| leading.receiver_count() > 0 && leading.send_replace(false))
            .count()
    }

    /// No longer fenced: runtimes granted from now on lead.
    pub(super) fn restore(&self) {
        self.lock().revoked = false;
    }
}

/// 64-bit FNV-1a, with a final avalanche (splitmix64's) so that inputs differing only in their
/// last bytes still spread over the whole range. Spelled out because std's hashers are not
/// guaranteed stable across Rust versions, and replicas built by different toolchains must agree.
pub(super) struct StableHasher(pub(super) u64);

impl StableHasher {
    pub(super) fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    pub(super) fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Length-prefixed, so ("ab", "c") and ("a", "bc") hash differently.
    pub(super) fn write_str(&mut self, text: &str) {
        self.write(&(text.len() as u64).to_le_bytes());
        self.write(text.as_bytes());
    }

    pub(super) fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

pub(super) fn weight(replica: &str, tenant: &str) -> u64 {
    let mut hasher = StableHasher::new();
    hasher.write_str(replica);
    hasher.write_str(tenant);
    hasher.finish()
}

/// Replicas sorted by identity, each with its incarnation (microseconds since the epoch). A
/// replica without one hashes as its name alone; an incarnation follows its name behind a length
/// no string can have, so it cannot be taken for another replica's name.
pub(super) fn view_id<'a>(
    sorted_replicas: impl IntoIterator<Item = (&'a str, Option<i64>)>,
) -> u64 {
    let mut hasher = StableHasher::new();
    for (replica, incarnation) in sorted_replicas {
        hasher.write_str(replica);
        if let Some(incarnation) = incarnation {
            hasher.write(&u64::MAX.to_le_bytes());
            hasher.write(&incarnation.to_le_bytes());
        }
    }
    hasher.finish()
}

/// The id of this replica's `fence`th fenced view: no membership hashes like it.
pub(super) fn fenced_view_id(identity: &str, fence: u64) -> u64 {
    let mut hasher = StableHasher::new();
    hasher.write_str("fenced");
    hasher.write_str(identity);
    hasher.write(&fence.to_le_bytes());
    hasher.finish()
}

pub(crate) fn hash_suffix(text: &str) -> String {
    let mut hasher = StableHasher::new();
    hasher.write_str(text);
    format!("{:08x}", hasher.finish() >> 32)
}

/// The Lease name of `identity` in `group`: a DNS-1123 subdomain (of lowercase alphanumerics and
/// dashes). When sanitizing changed or
/// shortened anything, a hash of the original is appended, so distinct identities keep distinct
/// Leases.
pub fn lease_name(group: &str, identity: &str) -> String {
    const MAX: usize = 253;
    let wanted = format!("{group}-{identity}");
    let mut name: String = wanted
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            // Dots would need alphanumerics on both sides; dashes only need them at the ends.
            c @ ('a'..='z' | '0'..='9' | '-') => c,
            _ => '-',
        })
        .collect();
    let trim = |name: &mut String| {
        let kept = name.trim_matches(|c: char| !c.is_ascii_alphanumeric());
        *name = kept.to_owned();
    };
    trim(&mut name);
    if name == wanted && name.len() <= MAX {
        return name;
    }
    let suffix = hash_suffix(&wanted);
    name.truncate(MAX - suffix.len() - 1);
    trim(&mut name);
    if name.is_empty() {
        suffix
    } else {
        format!("{name}-{suffix}")
    }
}

/// The group as a label value (at most 63 characters of `[A-Za-z0-9_.-]`, alphanumeric at both
/// ends), hashed like [`lease_name`] when it does not fit as it is.
pub fn group_label(group: &str) -> String {
    const MAX: usize = 63;
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let mut value: String = group
        .chars()
        .map(|c| if valid(c) { c } else { '-' })
        .collect();
    value = value
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned();
    if value == group && value.len() <= MAX {
        return value;
    }
    let suffix = hash_suffix(group);
    value.truncate(MAX - suffix.len() - 1);
    let value = value.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if value.is_empty() {
        suffix
    } else {
        format!("{value}-{suffix}")
    }
}
