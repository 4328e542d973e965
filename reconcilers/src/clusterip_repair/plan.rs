//! What a repair pass should do, decided from a snapshot: no I/O, no clock, no Kubernetes client.
//!
//! [`decide_ipaddress_mode`] follows upstream's `RepairIPAddress` (`syncService` for every
//! Service, then `syncIPAddress` for every allocator-managed IPAddress) finding for finding, with
//! the same event reasons, actions and notes; `audit.rs` decides for clusters that do not serve
//! IPAddress.

use std::cell::OnceCell;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::time::Duration;

use crate::alloc::{IpFamily, ServiceRange};

use super::model::{
    IPALLOCATOR_MANAGER, IpAddressRecord, IpLabels, ObjectVersion, ParentRef, ServiceCidrRecord,
};
use crate::contract::Change;
use crate::service_cache::record::{ClusterIp, ServiceRecord, ServiceRef};

/// Hash maps over IPs and names. foldhash is several times faster than SipHash here; names come
/// from whoever may create Services, and foldhash's per-process random seed is what keeps them
/// from aiming collisions at a pass (minimal DoS resistance, as its documentation puts it; names
/// are also short, validated DNS labels).
type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

fn fast_map<K, V>(capacity: usize) -> FastMap<K, V> {
    FastMap::with_capacity_and_hasher(capacity, foldhash::fast::RandomState::default())
}

/// Event actions upstream uses.
pub const ACTION_CLUSTERIP_VALIDATION: &str = "ClusterIPValidation";
pub const ACTION_CLUSTERIP_ALLOCATION: &str = "ClusterIPAllocation";
pub const ACTION_IPADDRESS_ALLOCATION: &str = "IPAddressAllocation";

/// The object an event is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Regarding {
    Service(ServiceRef),
    IpAddress { name: Box<str>, uid: Box<str> },
}

impl Regarding {
    pub(super) fn service(svc: &ServiceRecord) -> Self {
        Regarding::Service(ServiceRef::of(svc))
    }

    fn ip_address(ip: &IpAddressRecord) -> Self {
        Regarding::IpAddress {
            name: ip.name.to_string().into(),
            uid: ip.uid.to_string().into(),
        }
    }

    /// `Kind/namespace/name` or `Kind/name`, as the contract's `Drift::object` wants.
    pub fn object(&self) -> String {
        match self {
            Regarding::Service(service) => {
                format!("Service/{}/{}", service.namespace, service.name)
            }
            Regarding::IpAddress { name, .. } => format!("IPAddress/{name}"),
        }
    }
}

/// What is wrong with one cluster IP or one IPAddress: it names the drift and gives upstream's
/// event reason and action and the `type` of its error counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Problem {
    /// The Service's cluster IP does not parse, or is of a family no range has.
    NotValid,
    /// The cluster IP lies outside every configured range.
    OutOfRange,
    /// The cluster IP has no IPAddress.
    NotAllocated,
    /// The cluster IP's IPAddress names another parent.
    WrongReference,
    /// The cluster IP's IPAddress lacks the allocator's labels (upstream recreates it silently).
    WrongLabels,
    /// The cluster IP's IPAddress is another controller's: reported, left alone.
    ForeignManager,
    /// Another Service holds the cluster IP too.
    AlreadyAllocated,
    /// An IPAddress of the allocator's whose parent is no Service.
    NotAService,
    /// An IPAddress of the allocator's whose Service does not exist.
    Leaked,
    /// An IPAddress of the allocator's whose Service does not list it.
    WrongParent,
}

impl Problem {
    /// The drift kind in `check` output and the drift metrics.
    pub fn drift_kind(self) -> &'static str {
        match self {
            Problem::NotValid => "clusterip_not_valid",
            Problem::OutOfRange => "clusterip_out_of_range",
            Problem::NotAllocated => "clusterip_not_allocated",
            Problem::WrongReference => "ipaddress_wrong_reference",
            Problem::WrongLabels => "ipaddress_wrong_labels",
            Problem::ForeignManager => "ipaddress_foreign_manager",
            Problem::AlreadyAllocated => "clusterip_already_allocated",
            Problem::NotAService => "ipaddress_not_a_service",
            Problem::Leaked => "ipaddress_leaked",
            Problem::WrongParent => "ipaddress_wrong_parent",
        }
    }

    /// The Warning event's reason and action, upstream's; `None` where upstream emits none.
    pub fn event(self) -> Option<(&'static str, &'static str)> {
        Some(match self {
            Problem::NotValid => ("ClusterIPNotValid", ACTION_CLUSTERIP_VALIDATION),
            Problem::OutOfRange => ("ClusterIPOutOfRange", ACTION_CLUSTERIP_ALLOCATION),
            Problem::NotAllocated | Problem::WrongReference => {
                ("ClusterIPNotAllocated", ACTION_CLUSTERIP_ALLOCATION)
            }
            Problem::AlreadyAllocated => ("ClusterIPAlreadyAllocated", ACTION_CLUSTERIP_ALLOCATION),
            Problem::NotAService | Problem::Leaked => {
                ("IPAddressNotAllocated", ACTION_IPADDRESS_ALLOCATION)
            }
            Problem::WrongParent => ("IPAddressWrongReference", ACTION_IPADDRESS_ALLOCATION),
            Problem::WrongLabels | Problem::ForeignManager => return None,
        })
    }

    /// The `type` label of `clusterip_repair_ip_errors_total`, as upstream's legacy metric names
    /// them; `None` where upstream counts nothing.
    pub fn error_type(self) -> Option<&'static str> {
        Some(match self {
            Problem::NotValid => "invalid",
            Problem::OutOfRange => "outOfRange",
            Problem::NotAllocated | Problem::WrongReference => "repair",
            Problem::AlreadyAllocated => "duplicate",
            Problem::NotAService | Problem::Leaked | Problem::WrongParent => "leak",
            Problem::WrongLabels | Problem::ForeignManager => return None,
        })
    }
}

impl ObjectVersion {
    /// The version a delete of `existing` is conditional on.
    fn of(existing: &IpAddressRecord) -> Self {
        Self {
            uid: existing.uid.to_string().into(),
            resource_version: existing.resource_version.to_string().into(),
        }
    }
}

/// The write a finding calls for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Repair {
    /// Only report (upstream only reports, or the object is not ours).
    None,
    /// Create the missing IPAddress `ip` for `owner`.
    Create { ip: IpAddr, owner: ServiceRef },
    /// Delete the existing IPAddress (if still at `existing`) and create it again for `owner`.
    Recreate {
        ip: IpAddr,
        owner: ServiceRef,
        existing: ObjectVersion,
        /// The Service whose absence made the reference dangling, if that was the reason.
        dangling_parent: Option<ServiceRef>,
        /// The existing IPAddress in words (its parent and labels), for the repair's log line.
        was: Box<str>,
    },
    /// Delete the IPAddress named `name` (if still at `existing`). Why is the finding's
    /// problem: not a Service's ([`Problem::NotAService`], true whatever the Services are), its
    /// Service gone ([`Problem::Leaked`]) or not listing it ([`Problem::WrongParent`]).
    Delete {
        name: Box<str>,
        existing: ObjectVersion,
        /// The parent Service, which a live read must find gone or not listing the IP before
        /// the delete; `None` for a parent that is no Service.
        parent: Option<ServiceRef>,
        /// The IPAddress in words (its parent), for the repair's log line.
        was: Box<str>,
    },
}

/// An IPAddress for `owner` as the allocator writes it, in the words of a repair's log line.
fn as_allocated(ip: IpAddr, owner: &ServiceRef) -> String {
    format!(
        "IPAddress {ip} for Service {}/{}, labels ip-family={} managed-by={IPALLOCATOR_MANAGER}",
        owner.namespace,
        owner.name,
        IpFamily::of(ip).as_str()
    )
}

/// An IPAddress's parent reference in words: `for Service ns/name`, `for pods ns/name`, or
/// `with no parent`.
fn parent_words(parent: Option<&ParentRef>) -> String {
    match parent {
        Some(p) => format!("for {}", parent_name(p)),
        None => "with no parent".to_owned(),
    }
}

/// A parent reference as `Service ns/name`, `resource.group ns/name` or `resource name`.
fn parent_name(p: &ParentRef) -> String {
    let kind = match p.group() {
        "" if p.is_service() => "Service".to_owned(),
        "" => p.resource().to_owned(),
        group => format!("{}.{group}", p.resource()),
    };
    match &*p.namespace {
        "" => format!("{kind} {}", p.name),
        namespace => format!("{kind} {namespace}/{}", p.name),
    }
}

/// An IPAddress's two labels in words, `unset` where one is missing.
fn label_words(labels: &IpLabels) -> String {
    format!(
        "labels ip-family={} managed-by={}",
        labels.family().unwrap_or("unset"),
        labels.managed_by().unwrap_or("unset")
    )
}

impl Repair {
    pub fn deletes(&self) -> bool {
        matches!(self, Repair::Recreate { .. } | Repair::Delete { .. })
    }
}

/// One thing a pass found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub problem: Problem,
    pub regarding: Regarding,
    /// The note of the problem's Warning event, upstream's wording; empty where it has none.
    pub note: String,
    pub repair: Repair,
    /// For a cluster IP held twice: the other Service holding it (the first in etcd key
    /// order), which a live read must find holding it too before the finding is reported.
    pub shared_with: Option<SharedWith>,
}

/// The other Service holding a duplicated cluster IP, as the cache showed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedWith {
    pub ip: IpAddr,
    pub service: ServiceRef,
}

impl SharedWith {
    pub(super) fn of(ip: IpAddr, other: &ServiceRecord) -> Self {
        Self {
            ip,
            service: ServiceRef::of(other),
        }
    }
}

impl Finding {
    /// What the repair changes, in the words of its log line: the IPAddress before and after.
    /// `None` for a finding only reported.
    pub fn change(&self) -> Option<Change> {
        let (was, became) = match &self.repair {
            Repair::None => return None,
            Repair::Create { ip, owner } => {
                (format!("no IPAddress {ip}"), as_allocated(*ip, owner))
            }
            Repair::Recreate { ip, owner, was, .. } => (was.to_string(), as_allocated(*ip, owner)),
            Repair::Delete { was, .. } => (was.to_string(), "deleted".to_owned()),
        };
        Some(Change { was, became })
    }

    /// A sentence for the drift report.
    pub fn summary(&self) -> String {
        match (self.problem.event(), &self.repair) {
            (Some((reason, _)), _) => format!("{reason}: {}", self.note),
            (None, Repair::Recreate { ip, owner, .. }) => format!(
                "IPAddress {ip} for Service {}/{} lacks the allocator's labels; recreating it",
                owner.namespace, owner.name
            ),
            (None, _) if self.problem == Problem::ForeignManager => {
                "the IPAddress of a cluster IP of this Service is managed by another controller than \
                 ipallocator.k8s.io; left alone"
                    .to_owned()
            }
            (None, _) => self.problem.drift_kind().to_owned(),
        }
    }
}

/// The outcome of deciding one pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    pub findings: Vec<Finding>,
    /// Earliest time an IPAddress still inside a grace period becomes deletable: the loop should
    /// look again then.
    pub next_recheck: Option<jiff::Timestamp>,
    /// The uids of the IPAddresses waiting out a grace (see the `grace` module).
    pub waiting: Vec<Box<str>>,
    /// The uids of the IPAddresses deleted on their age that kube-apiserver's own clock shows
    /// past their grace (see the `grace` module).
    pub past_grace_on_api_clock: std::collections::BTreeSet<Box<str>>,
}

impl Decision {
    pub(super) fn recheck_by(&mut self, at: jiff::Timestamp) {
        self.next_recheck = Some(self.next_recheck.map_or(at, |earlier| earlier.min(at)));
    }

    /// `ip` waits out a grace until `at`.
    fn wait(&mut self, ip: &IpAddressRecord, at: jiff::Timestamp) {
        self.recheck_by(at);
        self.waiting.push(ObjectVersion::of(ip).uid);
    }

    /// `ip`, past its `grace` by its `creationTimestamp` at this controller's clock, is deleted:
    /// noted when it is past its grace on kube-apiserver's clock too, that is when an object
    /// in the view was created more than `grace` after it (`api_reached`, the newest
    /// `creationTimestamp` of the view, is a time kube-apiserver's clock has reached).
    fn past_grace(
        &mut self,
        ip: &IpAddressRecord,
        grace: jiff::SignedDuration,
        api_reached: Option<jiff::Timestamp>,
    ) {
        let past = ip
            .created
            .zip(api_reached)
            .is_some_and(|(created, reached)| {
                created.checked_add(grace).is_ok_and(|at| at < reached)
            });
        if past {
            self.past_grace_on_api_clock
                .insert(ObjectVersion::of(ip).uid);
        }
    }
}

/// Services by namespace/name, built only when a pass needs it: a consistent cluster never
/// does, because the Service phase has already matched every healthy IPAddress with its parent.
struct ServicesByKey<'i, 'a> {
    services: &'i [&'a ServiceRecord],
    map: OnceCell<FastMap<(&'a str, &'a str), &'a ServiceRecord>>,
}

impl<'a> ServicesByKey<'_, 'a> {
    fn get(&self, namespace: &str, name: &str) -> Option<&'a ServiceRecord> {
        self.map
            .get_or_init(|| {
                let mut map = fast_map(self.services.len());
                for svc in self.services {
                    map.insert((&*svc.namespace, &*svc.name), *svc);
                }
                map
            })
            .get(&(namespace, name))
            .copied()
    }
}

/// The position of the IPAddress each IP names (those whose name is no IP are not in it; of two
/// names of one IP, the later). The table holds only positions, found by the hash of the IP their
/// record names: a map of IPs to positions would take 24 bytes a slot, and a million-Service
/// cluster two million slots, every pass.
struct IpIndex<'i, 'a> {
    ip_addresses: &'i [&'a IpAddressRecord],
    positions: hashbrown::HashTable<u32>,
    hasher: foldhash::fast::RandomState,
}

impl<'i, 'a> IpIndex<'i, 'a> {
    fn of(ip_addresses: &'i [&'a IpAddressRecord]) -> Self {
        let mut index = IpIndex {
            ip_addresses,
            positions: hashbrown::HashTable::with_capacity(ip_addresses.len()),
            hasher: foldhash::fast::RandomState::default(),
        };
        let names = |at: u32| ip_addresses[at as usize].name.ip();
        for (at, ip) in ip_addresses.iter().enumerate() {
            let (Some(addr), Ok(at)) = (ip.name.ip(), u32::try_from(at)) else {
                continue;
            };
            let hash = index.hasher.hash_one(addr);
            let hasher = &index.hasher;
            match index.positions.entry(
                hash,
                |&held| names(held) == Some(addr),
                |&held| names(held).map_or(0, |ip| hasher.hash_one(ip)),
            ) {
                hashbrown::hash_table::Entry::Occupied(mut held) => *held.get_mut() = at,
                hashbrown::hash_table::Entry::Vacant(slot) => {
                    slot.insert(at);
                }
            }
        }
        index
    }

    fn get(&self, ip: IpAddr) -> Option<u32> {
        let ip_addresses = self.ip_addresses;
        self.positions
            .find(self.hasher.hash_one(ip), |&at| {
                ip_addresses[at as usize].name.ip() == Some(ip)
            })
            .copied()
    }
}

/// The lookups a pass makes, built once per pass.
struct Index<'i, 'a> {
    ip_addresses: &'i [&'a IpAddressRecord],
    ips_by_addr: IpIndex<'i, 'a>,
    services_by_key: ServicesByKey<'i, 'a>,
}

fn ranges_of<'a>(
    service_cidrs: impl IntoIterator<Item = &'a ServiceCidrRecord>,
) -> Vec<ServiceRange> {
    service_cidrs
        .into_iter()
        .flat_map(|cidr| cidr.cidrs.iter().copied())
        .map(ServiceRange::new)
        .collect()
}

/// What the Service phase found and did, for one run over some Services.
#[derive(Debug, Default)]
struct ServicePhase {
    findings: Vec<Finding>,
    /// IPAddresses (positions in `Index::ip_addresses`) this phase (re)creates: the IPAddress
    /// phase must not delete them.
    rewritten: Vec<u32>,
    /// IPAddresses whose parent is the Service that holds them first: the IPAddress phase has
    /// nothing to say about them.
    matched: Vec<u32>,
}

/// Which Service first held each IP during the Service phase (a later holder is a
/// duplicate): by the position of the IP's IPAddress, or, for the few IPs without one, by IP.
/// A map of every IP to its holder would take 56 bytes a slot, two million slots at a million
/// Services.
struct FirstHolders<'a> {
    by_ip_address: Vec<Option<&'a ServiceRecord>>,
    unallocated: FastMap<IpAddr, &'a ServiceRecord>,
}

impl<'a> FirstHolders<'a> {
    fn new(ip_addresses: usize) -> Self {
        FirstHolders {
            by_ip_address: vec![None; ip_addresses],
            unallocated: fast_map(0),
        }
    }

    /// The Service that held `ip` first, whose IPAddress is at `at` (if any).
    fn get(&self, ip: IpAddr, at: Option<u32>) -> Option<&'a ServiceRecord> {
        match at {
            Some(at) => self.by_ip_address[at as usize],
            None => self.unallocated.get(&ip).copied(),
        }
    }

    fn insert(&mut self, ip: IpAddr, at: Option<u32>, svc: &'a ServiceRecord) {
        match at {
            Some(at) => self.by_ip_address[at as usize] = Some(svc),
            None => {
                self.unallocated.insert(ip, svc);
            }
        }
    }
}

/// Decides a pass of the IPAddress-mode repair from a snapshot.
///
/// `orphan_grace` is upstream's 60 s: an IPAddress whose parent Service is missing is left alone
/// that long, since kube-apiserver writes the IPAddress before the Service.
pub fn decide_ipaddress_mode<'a>(
    services: impl IntoIterator<Item = &'a ServiceRecord>,
    ip_addresses: impl IntoIterator<Item = &'a IpAddressRecord>,
    service_cidrs: impl IntoIterator<Item = &'a ServiceCidrRecord>,
    now: jiff::Timestamp,
    orphan_grace: Duration,
) -> Decision {
    let mut services: Vec<&ServiceRecord> = services.into_iter().collect();
    // Upstream's legacy repair walks a LIST, in etcd key order: "who held it first" is the
    // Service with the smaller key. Its lister order is a map's; key order makes the outcome
    // the same whatever order the caches hold.
    services.sort_unstable_by(|a, b| a.key_cmp(b));
    let ip_addresses: Vec<&IpAddressRecord> = ip_addresses.into_iter().collect();
    let ranges = ranges_of(service_cidrs);
    let index = Index {
        ip_addresses: &ip_addresses,
        ips_by_addr: IpIndex::of(&ip_addresses),
        services_by_key: ServicesByKey {
            services: &services,
            map: OnceCell::new(),
        },
    };
    let mut phase = ServicePhase::default();
    let mut holders = FirstHolders::new(ip_addresses.len());
    for svc in &services {
        for cluster_ip in svc.cluster_ips.iter() {
            let at = cluster_ip.ip().and_then(|ip| index.ips_by_addr.get(ip));
            sync_service_ip(
                svc,
                cluster_ip,
                at,
                &ranges,
                &index,
                &mut holders,
                &mut phase,
            );
        }
    }

    let api_reached = (ip_addresses.iter().filter_map(|ip| ip.created))
        .chain(services.iter().filter_map(|svc| svc.created))
        .max();
    let mut settled = vec![false; ip_addresses.len()];
    for &at in phase.rewritten.iter().chain(&phase.matched) {
        settled[at as usize] = true;
    }
    let mut decision = Decision {
        findings: phase.findings,
        ..Decision::default()
    };
    let service_findings = decision.findings.len();
    for (ip, settled) in ip_addresses.iter().zip(settled) {
        if !settled {
            let at = Moment { now, api_reached };
            sync_ip_address(ip, &index.services_by_key, at, orphan_grace, &mut decision);
        }
    }
    // IPAddresses come in cache order; report them in name order (there are few findings, and
    // sorting them is cheaper than sorting every IPAddress).
    decision.findings[service_findings..].sort_by_key(|finding| finding.regarding.object());
    decision
}

/// The Service's cluster IP, if it is one and lies in a configured range; else `None`, and the
/// finding upstream's `syncService` reports for it is pushed.
fn valid_service_ip(
    svc: &ServiceRecord,
    raw: &ClusterIp,
    ranges: &[ServiceRange],
    phase: &mut ServicePhase,
) -> Option<IpAddr> {
    let Some(ip) = raw.ip() else {
        // Upstream prints the parsed value (always `<nil>`); the written value is what helps.
        phase.findings.push(Finding {
            problem: Problem::NotValid,
            regarding: Regarding::service(svc),
            note: format!("Cluster IP {raw} is not a valid IP; please recreate Service"),
            repair: Repair::None,
            shared_with: None,
        });
        return None;
    };
    let family = IpFamily::of(ip);
    if !ranges.iter().any(|range| range.holds_service_ip(ip)) {
        phase.findings.push(Finding {
            problem: Problem::OutOfRange,
            regarding: Regarding::service(svc),
            note: format!(
                    "Cluster IP [{family}]: {ip} is not within any configured Service CIDR; please recreate service"
                ),
            repair: Repair::None,
            shared_with: None,
        });
        return None;
    }
    Some(ip)
}

/// Upstream's `syncService` for one cluster IP; `at` is where `index.ip_addresses` holds the
/// IPAddress of that IP, looked up by the caller.
fn sync_service_ip<'a>(
    svc: &'a ServiceRecord,
    raw: &ClusterIp,
    at: Option<u32>,
    ranges: &[ServiceRange],
    index: &Index<'_, '_>,
    holders: &mut FirstHolders<'a>,
    phase: &mut ServicePhase,
) {
    let this = (&*svc.namespace, &*svc.name);
    let Some(ip) = valid_service_ip(svc, raw, ranges, phase) else {
        return;
    };
    let family = IpFamily::of(ip);
    if let Some(first) = holders.get(ip, at) {
        if (&*first.namespace, &*first.name) != this {
            phase.findings.push(already_allocated(svc, ip, Some(first)));
        }
        return;
    }

    let Some(at) = at else {
        holders.insert(ip, None, svc);
        phase.findings.push(Finding {
            problem: Problem::NotAllocated,
            regarding: Regarding::service(svc),
            note: format!("Cluster IP [{family}]: {ip} is not allocated; repairing"),
            repair: Repair::Create {
                ip,
                owner: ServiceRef::of(svc),
            },
            shared_with: None,
        });
        return;
    };
    sync_allocated_ip(svc, ip, at, index, holders, phase);
}

/// The rest of upstream's `syncService` for a cluster IP that has an IPAddress (at `at` in
/// `index.ip_addresses`): its manager, its parent reference and its labels.
fn sync_allocated_ip<'a>(
    svc: &'a ServiceRecord,
    ip: IpAddr,
    at: u32,
    index: &Index<'_, '_>,
    holders: &mut FirstHolders<'a>,
    phase: &mut ServicePhase,
) {
    let this = (&*svc.namespace, &*svc.name);
    let family = IpFamily::of(ip);
    let existing = index.ip_addresses[at as usize];
    let parent = existing.parent.as_ref();
    let parent_is_this =
        parent.is_some_and(|p| p.is_service() && (&*p.namespace, &*p.name) == this);

    if !existing.managed_by_ipallocator() {
        // Upstream recreates these; we never touch IPAddresses another controller manages.
        if parent_is_this {
            phase.findings.push(Finding {
                problem: Problem::ForeignManager,
                regarding: Regarding::service(svc),
                note: String::new(),
                repair: Repair::None,
                shared_with: None,
            });
        } else {
            held_elsewhere(svc, ip, existing, index, phase);
        }
        return;
    }

    let wrong_reference = |dangling| wrong_reference(svc, ip, existing, dangling);

    match parent {
        Some(p) if p.is_service() => {
            if !parent_is_this {
                match index.services_by_key.get(&p.namespace, &p.name) {
                    None => {
                        holders.insert(ip, Some(at), svc);
                        phase.rewritten.push(at);
                        phase.findings.push(wrong_reference(Some(ServiceRef::named(
                            &p.namespace,
                            &p.name,
                        ))));
                        return;
                    }
                    Some(referenced) if referenced.lists_ip(ip) => {
                        // Upstream goes on to the label check and may hand the IPAddress to
                        // this Service; the owner's own sync repairs labels without that churn.
                        phase
                            .findings
                            .push(already_allocated(svc, ip, Some(referenced)));
                        return;
                    }
                    // The IPAddress phase deletes it; the next pass recreates it for us.
                    Some(_) => {}
                }
            }
        }
        _ => {
            holders.insert(ip, Some(at), svc);
            phase.rewritten.push(at);
            phase.findings.push(wrong_reference(None));
            return;
        }
    }

    holders.insert(ip, Some(at), svc);
    let labels_right = existing.labels_as_allocated(family);
    if labels_right && parent_is_this {
        // The Service holding it first is the parent: the IPAddress phase would find the same.
        phase.matched.push(at);
    } else if !labels_right {
        phase.rewritten.push(at);
        phase.findings.push(wrong_labels(svc, ip, existing));
    }
}

/// The IPAddress of `svc`'s cluster IP `ip` (`existing`) references another object, or a
/// Service that does not exist (`dangling_parent`): recreated for `svc`.
fn wrong_reference(
    svc: &ServiceRecord,
    ip: IpAddr,
    existing: &IpAddressRecord,
    dangling_parent: Option<ServiceRef>,
) -> Finding {
    let family = IpFamily::of(ip);
    Finding {
        problem: Problem::WrongReference,
        regarding: Regarding::service(svc),
        note: format!(
            "the ClusterIP [{family}]: {ip} for Service {}/{} has a wrong reference; repairing",
            svc.namespace, svc.name
        ),
        repair: Repair::Recreate {
            ip,
            owner: ServiceRef::of(svc),
            existing: ObjectVersion::of(existing),
            was: match &dangling_parent {
                Some(gone) => format!(
                    "IPAddress {ip} for Service {}/{}, which does not exist",
                    gone.namespace, gone.name
                ),
                None => format!("IPAddress {ip} {}", parent_words(existing.parent.as_ref())),
            }
            .into(),
            dangling_parent,
        },
        shared_with: None,
    }
}

/// The IPAddress of `svc`'s cluster IP `ip` (`existing`) lacks the labels upstream's allocator
/// gives it: recreated with them.
fn wrong_labels(svc: &ServiceRecord, ip: IpAddr, existing: &IpAddressRecord) -> Finding {
    Finding {
        problem: Problem::WrongLabels,
        regarding: Regarding::service(svc),
        note: String::new(),
        repair: Repair::Recreate {
            ip,
            owner: ServiceRef::of(svc),
            existing: ObjectVersion::of(existing),
            dangling_parent: None,
            was: format!(
                "IPAddress {ip} {}, {}",
                parent_words(existing.parent.as_ref()),
                label_words(&existing.labels)
            )
            .into(),
        },
        shared_with: None,
    }
}

/// The finding for a cluster IP another Service (`other`, when the cache has it) holds too.
fn already_allocated(svc: &ServiceRecord, ip: IpAddr, other: Option<&ServiceRecord>) -> Finding {
    let family = IpFamily::of(ip);
    Finding {
        problem: Problem::AlreadyAllocated,
        regarding: Regarding::service(svc),
        note: format!(
            "Cluster IP [{family}]:{ip} was assigned to multiple services; please recreate service"
        ),
        repair: Repair::None,
        shared_with: other.map(|other| SharedWith::of(ip, other)),
    }
}

/// A cluster IP whose IPAddress another controller manages for someone else: reported on the
/// Service, never repaired. Upstream's "assigned to multiple services" only where another
/// Service does list the IP; otherwise the note says what holds it.
fn held_elsewhere(
    svc: &ServiceRecord,
    ip: IpAddr,
    existing: &IpAddressRecord,
    index: &Index<'_, '_>,
    phase: &mut ServicePhase,
) {
    let family = IpFamily::of(ip);
    let mut shared_with = None;
    let holder = match existing.parent.as_ref() {
        Some(p) if p.is_service() => match index.services_by_key.get(&p.namespace, &p.name) {
            Some(other) if other.lists_ip(ip) => {
                shared_with = Some(SharedWith::of(ip, other));
                None
            }
            Some(_) => Some(format!(
                "Service {}/{}, which does not list it",
                p.namespace, p.name
            )),
            None => Some(format!(
                "Service {}/{}, which does not exist",
                p.namespace, p.name
            )),
        },
        Some(p) => Some(parent_name(p)),
        None => Some("no parent".to_owned()),
    };
    let note = match holder {
        None => format!(
            "Cluster IP [{family}]:{ip} was assigned to multiple services; please recreate service"
        ),
        Some(holder) => {
            let manager = match existing.labels.managed_by() {
                Some(manager) => format!("managed by {manager}"),
                None => "without a managed-by label".to_owned(),
            };
            format!(
                "Cluster IP [{family}]:{ip} is held by {holder} (IPAddress {}, {manager}); please \
                 recreate service",
                existing.name
            )
        }
    };
    phase.findings.push(Finding {
        problem: Problem::AlreadyAllocated,
        regarding: Regarding::service(svc),
        note,
        repair: Repair::None,
        shared_with,
    });
}

/// Go's `%v` of a `*ParentReference`, as upstream's note prints it.
fn go_parent_ref(parent: Option<&ParentRef>) -> String {
    match parent {
        None => "<nil>".to_owned(),
        Some(p) => format!(
            "&{{{} {} {} {}}}",
            p.group(),
            p.resource(),
            p.namespace,
            p.name
        ),
    }
}

/// A pass's time: this controller's clock, and the newest time the view shows kube-apiserver's
/// clock has reached.
#[derive(Clone, Copy)]
struct Moment {
    now: jiff::Timestamp,
    api_reached: Option<jiff::Timestamp>,
}

fn sync_ip_address(
    ip: &IpAddressRecord,
    services_by_key: &ServicesByKey<'_, '_>,
    Moment { now, api_reached }: Moment,
    orphan_grace: Duration,
    decision: &mut Decision,
) {
    if !ip.managed_by_ipallocator() || ip.deleting {
        return;
    }
    let parent = match ip.parent.as_ref() {
        Some(parent) if parent.is_service() => parent,
        _ => {
            decision.findings.push(clean_up(ip, Problem::NotAService));
            return;
        }
    };
    let addr = ip.name.ip();
    match services_by_key.get(&parent.namespace, &parent.name) {
        None => {
            let grace =
                jiff::SignedDuration::try_from(orphan_grace).unwrap_or(jiff::SignedDuration::MAX);
            let turns_deletable = ip
                .created
                .and_then(|created| created.checked_add(grace).ok());
            match turns_deletable {
                Some(at) if at >= now => decision.wait(ip, at),
                _ => {
                    decision.past_grace(ip, grace, api_reached);
                    decision.findings.push(clean_up(ip, Problem::Leaked));
                }
            }
        }
        Some(svc) => {
            let listed = addr.is_some_and(|addr| svc.lists_ip(addr));
            if !listed && let Some(at) = written_ahead_of_its_service(ip, svc, now) {
                decision.wait(ip, at);
            } else if !listed {
                decision.past_grace(ip, UNLISTED_GRACE, api_reached);
                decision.findings.push(clean_up(ip, Problem::WrongParent));
            }
        }
    }
}

/// An IPAddress deleted as a leak (`problem`: [`Problem::NotAService`], [`Problem::Leaked`] or
/// [`Problem::WrongParent`]), with upstream's event note.
fn clean_up(ip: &IpAddressRecord, problem: Problem) -> Finding {
    let name = &ip.name;
    let parent = ip.parent.as_ref().filter(|p| p.is_service());
    let (note, was) = match (problem, parent) {
        (Problem::Leaked, Some(p)) => (
            format!(
                "IPAddress: {name} for Service {}/{} appears to have leaked: cleaning up",
                p.namespace, p.name
            ),
            format!(
                "IPAddress {name} for Service {}/{}, which does not exist",
                p.namespace, p.name
            ),
        ),
        (Problem::WrongParent, Some(p)) => (
            format!(
                "IPAddress: {name} for Service {}/{} has a wrong reference; cleaning up",
                p.namespace, p.name
            ),
            format!(
                "IPAddress {name} for Service {}/{}, which does not list it",
                p.namespace, p.name
            ),
        ),
        _ => (
            format!(
                "IPAddress {name} appears to have been modified, not referencing a Service {}: cleaning up",
                go_parent_ref(ip.parent.as_ref())
            ),
            format!("IPAddress {name} {}", parent_words(ip.parent.as_ref())),
        ),
    };
    Finding {
        problem,
        regarding: Regarding::ip_address(ip),
        note,
        repair: Repair::Delete {
            name: name.to_string().into(),
            existing: ObjectVersion::of(ip),
            was: was.into(),
            parent: parent.map(|p| ServiceRef::named(&p.namespace, &p.name)),
        },
        shared_with: None,
    }
}

/// How long an IPAddress newer than its Service may go unlisted by it (upstream's 5 s):
/// kube-apiserver writes the IPAddress first and then the Service update that lists it (a
/// dual-stack upgrade, ExternalName to ClusterIP, a retried create). Deleting it in between would
/// free an IP that is about to be in use.
pub const UNLISTED_GRACE: jiff::SignedDuration = jiff::SignedDuration::from_secs(5);

/// When an IPAddress its Service does not list turns deletable, if it is still in
/// [`UNLISTED_GRACE`]: only one created after its Service can be waiting for the Service's
/// update; one older than its Service was left behind by a Service of the same name. Creation
/// times have whole seconds, so one of the same second as its Service may be the newer (a
/// Service created as ExternalName and at once changed to ClusterIP): it waits too, as waiting
/// costs a few seconds and deleting it would free an IP about to be in use.
fn written_ahead_of_its_service(
    ip: &IpAddressRecord,
    svc: &ServiceRecord,
    now: jiff::Timestamp,
) -> Option<jiff::Timestamp> {
    let (ip_created, svc_created) = (ip.created?, svc.created?);
    if ip_created < svc_created {
        return None;
    }
    let at = ip_created.checked_add(UNLISTED_GRACE).ok()?;
    (at > now).then_some(at)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::audit::decide_audit_mode;
    use super::*;
    use crate::clusterip_repair::model::{IPALLOCATOR_MANAGER, IpLabels};
    use crate::service_cache::record::Token;

    const GRACE: Duration = Duration::from_secs(60);

    fn now() -> jiff::Timestamp {
        "2026-11-22T03:00:00Z".parse().unwrap()
    }

    fn svc(ns: &str, name: &str, ips: &[&str]) -> ServiceRecord {
        ServiceRecord {
            namespace: ns.into(),
            name: name.into(),
            uid: Token::new(&format!("uid-{ns}-{name}")),
            resource_version: 1,
            cluster_ips: ips.iter().map(|ip| ClusterIp::parse(ip)).collect(),
            node_ports: Default::default(),
            health_check_node_port: 0,
            created: None,
        }
    }

    fn ipaddr(
        ip: &str,
        parent: Option<(&str, &'static str, &str, &str)>,
        age_secs: i64,
    ) -> IpAddressRecord {
        let family = if ip.contains(':') { "IPv6" } else { "IPv4" };
        IpAddressRecord {
            name: ip.into(),
            uid: Token::new(&format!("uid-{ip}")),
            resource_version: "5".into(),
            labels: IpLabels::new(Some(IPALLOCATOR_MANAGER), Some(family)),
            parent: parent.map(|(group, resource, namespace, name)| {
                ParentRef::new(group, resource, namespace.into(), name.into())
            }),
            created: Some(now() - jiff::SignedDuration::from_secs(age_secs)),
            deleting: false,
        }
    }

    fn owned(ip: &str, ns: &str, name: &str) -> IpAddressRecord {
        ipaddr(ip, Some(("", "services", ns, name)), 3600)
    }

    fn cidrs() -> Vec<ServiceCidrRecord> {
        vec![ServiceCidrRecord {
            name: "kubernetes".into(),
            resource_version: 1,
            cidrs: vec![
                "10.0.0.0/24".parse().unwrap(),
                "fd00::/108".parse().unwrap(),
            ],
            deleting: false,
        }]
    }

    fn decide(services: &[ServiceRecord], ips: &[IpAddressRecord]) -> Decision {
        decide_ipaddress_mode(services, ips, &cidrs(), now(), GRACE)
    }

    fn reasons(decision: &Decision) -> Vec<(&'static str, String)> {
        decision
            .findings
            .iter()
            .filter_map(|f| {
                f.problem
                    .event()
                    .map(|(reason, _)| (reason, f.note.clone()))
            })
            .collect()
    }

    #[test]
    fn consistent_dual_stack_state_has_no_findings() {
        let services = [svc("d", "a", &["10.0.0.5", "fd00::5"]), svc("d", "h", &[])];
        let ips = [owned("10.0.0.5", "d", "a"), owned("fd00::5", "d", "a")];
        let decision = decide(&services, &ips);
        assert_eq!(decision, Decision::default());
    }

    #[test]
    fn invalid_cluster_ip_is_reported() {
        let decision = decide(&[svc("d", "a", &["10.0.0.999"])], &[]);
        assert_eq!(
            reasons(&decision),
            [(
                "ClusterIPNotValid",
                "Cluster IP 10.0.0.999 is not a valid IP; please recreate Service".to_owned()
            )]
        );
        let finding = &decision.findings[0];
        assert_eq!(finding.problem.event().unwrap().1, "ClusterIPValidation");
        assert_eq!(finding.problem.error_type(), Some("invalid"));
        assert_eq!(finding.repair, Repair::None);
    }

    #[test]
    fn out_of_range_is_reported_without_write() {
        let decision = decide(&[svc("d", "a", &["10.1.0.5", "10.0.0.255"])], &[]);
        assert_eq!(
            reasons(&decision),
            [
                (
                    "ClusterIPOutOfRange",
                    "Cluster IP [IPv4]: 10.1.0.5 is not within any configured Service CIDR; please recreate service".to_owned()
                ),
                (
                    "ClusterIPOutOfRange",
                    "Cluster IP [IPv4]: 10.0.0.255 is not within any configured Service CIDR; please recreate service".to_owned()
                ),
            ]
        );
        assert!(decision.findings.iter().all(|f| f.repair == Repair::None));
    }

    #[test]
    fn missing_ipaddress_is_created_per_family() {
        let decision = decide(
            &[svc("d", "a", &["10.0.0.5", "fd00::5"])],
            &[owned("10.0.0.5", "d", "a")],
        );
        assert_eq!(
            reasons(&decision),
            [(
                "ClusterIPNotAllocated",
                "Cluster IP [IPv6]: fd00::5 is not allocated; repairing".to_owned()
            )]
        );
        assert_eq!(
            decision.findings[0].repair,
            Repair::Create {
                ip: "fd00::5".parse().unwrap(),
                owner: ServiceRef {
                    namespace: "d".into(),
                    name: "a".into(),
                    uid: "uid-d-a".into(),
                }
            }
        );
        assert_eq!(
            decision.findings[0].problem.event().unwrap().1,
            "ClusterIPAllocation"
        );
    }

    #[test]
    fn two_services_without_ipaddress_create_once_and_report_the_second() {
        let decision = decide(
            &[svc("d", "b", &["10.0.0.5"]), svc("d", "a", &["10.0.0.5"])],
            &[],
        );
        let kinds: Vec<_> = decision
            .findings
            .iter()
            .map(|f| (f.problem.drift_kind(), f.regarding.object()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("clusterip_not_allocated", "Service/d/a".to_owned()),
                ("clusterip_already_allocated", "Service/d/b".to_owned())
            ]
        );
    }

    #[test]
    fn findings_come_in_key_order_whatever_the_cache_order() {
        // No IP is contested; the findings still come in the order of the etcd keys as bytes
        // ("a-b/x" before "a/y": `-` sorts below `/`).
        let services = [
            svc("a-b", "x", &["10.0.0.3"]),
            svc("a", "z", &["10.0.0.2", "fd00::2"]),
            svc("a", "y", &["10.0.0.1"]),
        ];
        let expected = [
            ("Service/a-b/x", "10.0.0.3"),
            ("Service/a/y", "10.0.0.1"),
            ("Service/a/z", "10.0.0.2"),
            ("Service/a/z", "fd00::2"),
        ];
        let mut reversed = services.clone();
        reversed.reverse();
        for order in [&services[..], &reversed[..]] {
            let decision = decide(order, &[]);
            let got: Vec<(String, String)> = decision
                .findings
                .iter()
                .map(|f| match &f.repair {
                    Repair::Create { ip, .. } => (f.regarding.object(), ip.to_string()),
                    other => panic!("unexpected repair {other:?}"),
                })
                .collect();
            let want: Vec<(String, String)> = expected
                .iter()
                .map(|(object, ip)| ((*object).to_owned(), (*ip).to_owned()))
                .collect();
            assert_eq!(got, want);
        }
    }

    /// Two Services holding one IP: the one whose etcd key comes first holds it, as in
    /// upstream's walk of a LIST; the event lands on the other. `a-b/x` sorts before `a/z`
    /// (`-` is below `/`), although namespace "a" sorts before "a-b".
    #[test]
    fn a_duplicate_lands_on_the_later_etcd_key() {
        let services = [svc("a", "z", &["10.0.0.5"]), svc("a-b", "x", &["10.0.0.5"])];
        let mut reversed = services.clone();
        reversed.reverse();
        for order in [&services[..], &reversed[..]] {
            let decision = decide(order, &[]);
            let got: Vec<_> = decision
                .findings
                .iter()
                .map(|f| (f.problem.drift_kind(), f.regarding.object()))
                .collect();
            assert_eq!(
                got,
                [
                    ("clusterip_not_allocated", "Service/a-b/x".to_owned()),
                    ("clusterip_already_allocated", "Service/a/z".to_owned())
                ]
            );
            let audit = decide_audit_mode(order, &configured());
            let got: Vec<_> = audit
                .findings
                .iter()
                .map(|f| (f.problem.drift_kind(), f.regarding.object()))
                .collect();
            assert_eq!(
                got,
                [("clusterip_already_allocated", "Service/a/z".to_owned())]
            );
        }
    }

    /// An IPAddress another controller manages for something that is not a Service (a
    /// Gateway): the Service listing the IP is told what holds it, not "multiple services".
    #[test]
    fn an_ip_held_by_a_gateway_is_reported_as_such() {
        let mut held = ipaddr(
            "10.0.0.5",
            Some(("gateway.networking.k8s.io", "gateways", "infra", "edge")),
            3600,
        );
        held.labels.set_managed_by(Some("gateway.example.com"));
        let decision = decide(&[svc("d", "a", &["10.0.0.5"])], &[held]);
        assert_eq!(
            reasons(&decision),
            [(
                "ClusterIPAlreadyAllocated",
                "Cluster IP [IPv4]:10.0.0.5 is held by gateways.gateway.networking.k8s.io \
                 infra/edge (IPAddress 10.0.0.5, managed by gateway.example.com); please \
                 recreate service"
                    .to_owned()
            )]
        );
        assert_eq!(decision.findings[0].repair, Repair::None);
        assert_eq!(decision.findings[0].problem.error_type(), Some("duplicate"));
    }

    /// The same for a foreign IPAddress naming another Service: "multiple services" only when
    /// that Service exists and lists the IP.
    #[test]
    fn a_foreign_ipaddress_of_another_service_is_described_as_it_is() {
        let foreign = |parent: Option<(&str, &'static str, &str, &str)>| {
            let mut ip = ipaddr("10.0.0.5", parent, 3600);
            ip.labels.set_managed_by(Some("other.example.com"));
            ip
        };
        let note = |services: &[ServiceRecord], ip: IpAddressRecord| {
            let decision = decide(services, &[ip]);
            let found: Vec<_> = decision
                .findings
                .iter()
                .filter(|f| f.regarding.object() == "Service/d/a")
                .map(|f| f.note.clone())
                .collect();
            assert_eq!(found.len(), 1, "{decision:?}");
            found[0].clone()
        };
        let a = svc("d", "a", &["10.0.0.5"]);
        assert_eq!(
            note(
                &[a.clone(), svc("d", "b", &["10.0.0.5"])],
                foreign(Some(("", "services", "d", "b")))
            ),
            "Cluster IP [IPv4]:10.0.0.5 was assigned to multiple services; please recreate service"
        );
        assert_eq!(
            note(
                std::slice::from_ref(&a),
                foreign(Some(("", "services", "d", "gone")))
            ),
            "Cluster IP [IPv4]:10.0.0.5 is held by Service d/gone, which does not exist \
             (IPAddress 10.0.0.5, managed by other.example.com); please recreate service"
        );
        assert_eq!(
            note(
                &[a.clone(), svc("d", "b", &["10.0.0.6"])],
                foreign(Some(("", "services", "d", "b")))
            ),
            "Cluster IP [IPv4]:10.0.0.5 is held by Service d/b, which does not list it \
             (IPAddress 10.0.0.5, managed by other.example.com); please recreate service"
        );
        assert_eq!(
            note(&[a], foreign(None)),
            "Cluster IP [IPv4]:10.0.0.5 is held by no parent (IPAddress 10.0.0.5, managed by \
             other.example.com); please recreate service"
        );
    }

    #[test]
    fn an_ip_listed_twice_by_one_service_is_repaired_once() {
        let decision = decide(&[svc("d", "a", &["10.0.0.5", "10.0.0.5"])], &[]);
        assert_eq!(decision.findings.len(), 1);
        assert_eq!(
            decision.findings[0].problem.drift_kind(),
            "clusterip_not_allocated"
        );
        let consistent = decide(
            &[svc("d", "a", &["10.0.0.5", "10.0.0.5"])],
            &[owned("10.0.0.5", "d", "a")],
        );
        assert_eq!(consistent.findings, []);
    }

    #[test]
    fn reference_to_non_service_is_recreated_for_the_service() {
        let ips = [ipaddr(
            "10.0.0.5",
            Some(("gateway.networking.k8s.io", "gateways", "d", "a")),
            3600,
        )];
        let decision = decide(&[svc("d", "a", &["10.0.0.5"])], &ips);
        assert_eq!(
            reasons(&decision),
            [(
                "ClusterIPNotAllocated",
                "the ClusterIP [IPv4]: 10.0.0.5 for Service d/a has a wrong reference; repairing"
                    .to_owned()
            )]
        );
        assert!(matches!(
            decision.findings[0].repair,
            Repair::Recreate {
                dangling_parent: None,
                ..
            }
        ));
        assert_eq!(
            decision.findings.len(),
            1,
            "the IPAddress phase leaves the rewritten object alone"
        );
    }

    #[test]
    fn dangling_reference_is_recreated_for_the_service() {
        let decision = decide(
            &[svc("d", "a", &["10.0.0.5"])],
            &[owned("10.0.0.5", "d", "gone")],
        );
        assert_eq!(decision.findings.len(), 1);
        assert_eq!(
            decision.findings[0].problem.drift_kind(),
            "ipaddress_wrong_reference"
        );
        match &decision.findings[0].repair {
            Repair::Recreate {
                owner,
                existing,
                dangling_parent,
                ..
            } => {
                assert_eq!(&*owner.name, "a");
                assert_eq!(&*existing.uid, "uid-10.0.0.5");
                assert_eq!(dangling_parent.as_ref().map(|p| &*p.name), Some("gone"));
            }
            other => panic!("unexpected repair {other:?}"),
        }
    }

    /// A cluster with every kind of damage, from a seed: Services drawing IPs from `pool` IPs
    /// (a small pool makes Services share IPs), IPAddresses with every kind of parent, manager,
    /// label, age and deletion state.
    fn damaged_cluster(seed: u64, pool: u32) -> (Vec<ServiceRecord>, Vec<IpAddressRecord>) {
        let mut state = seed.max(1);
        let mut next = move |below: u32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % u64::from(below)) as u32
        };
        // Distinct for every n below 250.
        let ip_of = |n: u32| match n % 3 {
            0 => format!("fd00::{:x}", n + 1),
            _ => format!("10.0.0.{}", n % 250 + 1),
        };
        let mut services = Vec::new();
        for i in 0..60 {
            let ips: Vec<String> = match next(20) {
                0 => vec!["10.0.0.300".to_owned()],
                1 => vec!["10.9.9.9".to_owned()],
                2 => vec![],
                3..=5 => vec![ip_of(next(pool)), ip_of(next(pool))],
                _ => vec![ip_of(next(pool))],
            };
            let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
            services.push(svc(&format!("ns{}", next(3)), &format!("s{i}"), &ips));
        }
        let mut ips = Vec::new();
        for n in 0..pool {
            if next(5) == 0 {
                continue;
            }
            let parent_ns = format!("ns{}", next(3));
            let parent_name = format!("s{}", next(70));
            let parent = match next(8) {
                0 => None,
                1 => Some(("", "pods", parent_ns.as_str(), parent_name.as_str())),
                _ => Some(("", "services", parent_ns.as_str(), parent_name.as_str())),
            };
            let mut record = ipaddr(&ip_of(n), parent, if next(2) == 0 { 10 } else { 3600 });
            match next(10) {
                0 => record.labels.set_managed_by(Some("other.example.com")),
                1 => record.labels.set_family(None),
                2 => record.deleting = true,
                _ => {}
            }
            ips.push(record);
        }
        // Most IPAddresses name a Service that lists them.
        for svc in &services {
            for ip in svc.cluster_ips.iter().filter_map(ClusterIp::ip) {
                if next(4) != 0 {
                    continue;
                }
                if let Some(record) = ips.iter_mut().find(|r| r.name.ip() == Some(ip)) {
                    record.parent = Some(ParentRef::new(
                        "",
                        "services",
                        svc.namespace.clone(),
                        svc.name.clone(),
                    ));
                }
            }
        }
        (services, ips)
    }

    fn same_findings(decided: &Decision, reference: &Decision, case: &str) {
        let differs = decided
            .findings
            .iter()
            .zip(&reference.findings)
            .position(|(a, b)| a != b);
        assert_eq!(
            (decided.findings.len(), differs, decided.next_recheck),
            (reference.findings.len(), None, reference.next_recheck),
            "{case}: first difference {:?}",
            differs.map(|at| (&decided.findings[at], &reference.findings[at]))
        );
    }

    /// The decision does not depend on the order the caches hold the objects in: it is
    /// upstream's walk in key order whatever the order given.
    #[test]
    fn cache_order_does_not_change_the_decision() {
        let mut kinds = std::collections::BTreeSet::new();
        let mut contested_seen = false;
        for seed in 1..40u64 {
            // A pool of 40 IPs for 60 Services: shared IPs; 240: rarely.
            for pool in [40, 240] {
                let (services, ips) = damaged_cluster(seed, pool);
                let reference = decide_ipaddress_mode(&services, &ips, &cidrs(), now(), GRACE);
                contested_seen |= reference
                    .findings
                    .iter()
                    .any(|f| f.problem == Problem::AlreadyAllocated);
                kinds.extend(reference.findings.iter().map(|f| f.problem.drift_kind()));
                let mut reversed = services.clone();
                reversed.reverse();
                let mut reversed_ips = ips.clone();
                reversed_ips.reverse();
                let decided =
                    decide_ipaddress_mode(&reversed, &reversed_ips, &cidrs(), now(), GRACE);
                same_findings(&decided, &reference, &format!("seed {seed}, pool {pool}"));
            }
        }
        assert!(contested_seen, "some seeds have IPs held twice");
        assert!(
            kinds.len() >= 9,
            "the seeds cover most kinds of finding: {kinds:?}"
        );
    }

    #[test]
    fn ip_claimed_by_two_live_services_is_only_reported() {
        let services = [svc("d", "a", &["10.0.0.5"]), svc("d", "b", &["10.0.0.5"])];
        let decision = decide(&services, &[owned("10.0.0.5", "d", "a")]);
        assert_eq!(
            reasons(&decision),
            [(
                "ClusterIPAlreadyAllocated",
                "Cluster IP [IPv4]:10.0.0.5 was assigned to multiple services; please recreate service".to_owned()
            )]
        );
        assert_eq!(decision.findings[0].regarding.object(), "Service/d/b");
        assert_eq!(decision.findings[0].repair, Repair::None);
    }

    #[test]
    fn reference_to_service_not_listing_the_ip_is_left_to_the_ipaddress_phase() {
        let services = [svc("d", "a", &["10.0.0.5"]), svc("d", "b", &["10.0.0.6"])];
        let ips = [owned("10.0.0.5", "d", "b"), owned("10.0.0.6", "d", "b")];
        let decision = decide(&services, &ips);
        assert_eq!(
            reasons(&decision),
            [(
                "IPAddressWrongReference",
                "IPAddress: 10.0.0.5 for Service d/b has a wrong reference; cleaning up".to_owned()
            )]
        );
        assert!(matches!(
            &decision.findings[0].repair,
            Repair::Delete {
                parent: Some(_),
                ..
            }
        ));
        assert_eq!(decision.findings[0].problem, Problem::WrongParent);
        assert_eq!(
            decision.findings[0].regarding.object(),
            "IPAddress/10.0.0.5"
        );
    }

    /// upstream repairip_test.go's three "Two IPAddresses referencing the same service" cases:
    /// the Service created at t+1 lists 10.0.0.5; 10.0.0.6 also names it as parent.
    #[test]
    fn ipaddress_newer_than_its_service_is_kept_unlisted_for_five_seconds() {
        let t = now();
        let at = |secs| t + jiff::SignedDuration::from_secs(secs);
        let mut service = svc("bar", "test-svc", &["10.0.0.5"]);
        service.created = Some(at(1));
        let ip = |name, created| IpAddressRecord {
            created: Some(created),
            ..owned(name, "bar", "test-svc")
        };
        let decide_at = |second_created, pass_at| {
            let ips = [ip("10.0.0.5", t), ip("10.0.0.6", second_created)];
            decide_ipaddress_mode([&service], &ips, &cidrs(), pass_at, GRACE)
        };
        let wrong_reference = [(
            "IPAddressWrongReference",
            "IPAddress: 10.0.0.6 for Service bar/test-svc has a wrong reference; cleaning up"
                .to_owned(),
        )];

        // Older than its Service: left behind by an earlier Service of that name.
        assert_eq!(reasons(&decide_at(t, t)), wrong_reference);
        // "...when service create is called again and ip address is in grace period": written
        // at t+2, ahead of the Service's update; at t+3 it is kept and looked at again at t+7.
        let in_grace = decide_at(at(2), at(3));
        assert_eq!(in_grace.findings, []);
        assert_eq!(in_grace.next_recheck, Some(at(7)));
        // "...not in grace period": at t+10 the Service has had its time to list it.
        assert_eq!(reasons(&decide_at(at(2), at(10))), wrong_reference);
        // Written in the Service's own second (an ExternalName Service changed to ClusterIP
        // at once): it may be the newer, so it waits as well.
        let same_second = decide_at(at(1), at(1));
        assert_eq!(same_second.findings, []);
        assert_eq!(same_second.next_recheck, Some(at(6)));
        assert_eq!(reasons(&decide_at(at(1), at(7))), wrong_reference);
    }

    #[test]
    fn wrong_labels_are_recreated_silently() {
        let mut ip = owned("fd00::5", "d", "a");
        ip.labels.set_family(Some("IPv4"));
        let decision = decide(&[svc("d", "a", &["fd00::5"])], &[ip]);
        assert_eq!(decision.findings.len(), 1);
        assert_eq!(
            decision.findings[0].problem.drift_kind(),
            "ipaddress_wrong_labels"
        );
        assert!(decision.findings[0].problem.event().is_none());
        assert!(decision.findings[0].repair.deletes());
    }

    #[test]
    fn ipaddress_of_other_managers_is_never_touched() {
        let mut mine = owned("10.0.0.5", "d", "a");
        mine.labels.set_managed_by(Some("someone-else"));
        let mut stray = owned("10.0.0.9", "d", "gone");
        stray.labels.set_managed_by(None);
        let mut taken = owned("10.0.0.7", "d", "other");
        taken.labels.set_managed_by(Some("someone-else"));
        let decision = decide(
            &[svc("d", "a", &["10.0.0.5"]), svc("d", "c", &["10.0.0.7"])],
            &[mine, stray, taken],
        );
        assert!(
            decision.findings.iter().all(|f| f.repair == Repair::None),
            "{decision:?}"
        );
        let kinds: Vec<_> = decision
            .findings
            .iter()
            .map(|f| f.problem.drift_kind())
            .collect();
        assert_eq!(
            kinds,
            ["ipaddress_foreign_manager", "clusterip_already_allocated"]
        );
        assert!(
            decision.findings[0]
                .summary()
                .contains("another controller")
        );
    }

    #[test]
    fn ipaddress_not_referencing_a_service_is_deleted() {
        let ips = [
            ipaddr("10.0.0.7", Some(("x.io", "things", "d", "t")), 3600),
            ipaddr("10.0.0.8", None, 3600),
        ];
        let decision = decide(&[], &ips);
        assert_eq!(
            reasons(&decision),
            [
                (
                    "IPAddressNotAllocated",
                    "IPAddress 10.0.0.7 appears to have been modified, not referencing a Service &{x.io things d t}: cleaning up".to_owned()
                ),
                (
                    "IPAddressNotAllocated",
                    "IPAddress 10.0.0.8 appears to have been modified, not referencing a Service <nil>: cleaning up".to_owned()
                ),
            ]
        );
        assert!(
            decision
                .findings
                .iter()
                .all(|f| f.problem == Problem::NotAService
                    && matches!(f.repair, Repair::Delete { parent: None, .. }))
        );
        assert_eq!(
            decision.findings[0].problem.event().unwrap().1,
            "IPAddressAllocation"
        );
    }

    #[test]
    fn leaked_ipaddress_is_deleted_only_after_the_grace_period() {
        let old = ipaddr("10.0.0.7", Some(("", "services", "d", "gone")), 61);
        let young = ipaddr("10.0.0.8", Some(("", "services", "d", "coming")), 20);
        let younger = ipaddr("10.0.0.9", Some(("", "services", "d", "coming2")), 5);
        let decision = decide(&[], &[old, young, younger]);
        assert_eq!(
            reasons(&decision),
            [(
                "IPAddressNotAllocated",
                "IPAddress: 10.0.0.7 for Service d/gone appears to have leaked: cleaning up"
                    .to_owned()
            )]
        );
        assert_eq!(
            decision.next_recheck,
            Some(now() + jiff::SignedDuration::from_secs(40))
        );
    }

    /// A leak is past its grace on kube-apiserver's clock only when the view holds an object
    /// created more than the grace after it; an hour past on this controller's clock alone
    /// (a clock that runs ahead) is not.
    #[test]
    fn a_leak_is_past_its_grace_on_the_apis_clock_only_when_a_newer_object_shows_it() {
        let leak = ipaddr("10.0.0.7", Some(("", "services", "d", "gone")), 3600);
        let alone = decide(&[], std::slice::from_ref(&leak));
        assert_eq!(alone.findings.len(), 1);
        assert!(alone.past_grace_on_api_clock.is_empty());

        let within = ipaddr("10.0.0.8", Some(("", "services", "d", "web")), 3600 - 60);
        let mut after = svc("d", "web", &["10.0.0.8"]);
        after.created = Some(now() - jiff::SignedDuration::from_secs(3600 - 61));
        let near = decide(&[], &[leak.clone(), within.clone()]);
        assert!(near.past_grace_on_api_clock.is_empty(), "{near:#?}");
        let shown = decide(&[after], &[leak, within]);
        assert_eq!(
            (shown.past_grace_on_api_clock.iter())
                .map(|uid| &**uid)
                .collect::<Vec<_>>(),
            ["uid-10.0.0.7"]
        );
    }

    #[test]
    fn ipaddress_without_creation_time_counts_as_old() {
        let mut ip = ipaddr("10.0.0.7", Some(("", "services", "d", "gone")), 0);
        ip.created = None;
        assert_eq!(decide(&[], &[ip]).findings.len(), 1);
    }

    #[test]
    fn terminating_ipaddress_is_left_alone() {
        let mut ip = ipaddr("10.0.0.7", Some(("", "services", "d", "gone")), 3600);
        ip.deleting = true;
        assert!(decide(&[], &[ip]).findings.is_empty());
    }

    /// Every repair says, for its log line, what the IPAddress was and what it became; a
    /// finding only reported has no change.
    #[test]
    fn each_repair_says_what_the_ipaddress_was_and_became() {
        let mut relabeled = owned("fd00::5", "d", "b");
        relabeled.labels.set_family(Some("IPv4"));
        let services = [
            svc("d", "a", &["10.0.0.5", "10.0.0.9"]),
            svc("d", "b", &["10.0.0.6", "fd00::5"]),
            svc("d", "c", &["10.0.0.7"]),
            svc("d", "e", &["10.0.0.12"]),
            svc("d", "f", &["10.1.0.1"]),
        ];
        let ips = [
            ipaddr("10.0.0.6", Some(("x.io", "things", "d", "t")), 3600),
            owned("10.0.0.7", "d", "gone"),
            relabeled,
            owned("10.0.0.9", "d", "a"),
            ipaddr("10.0.0.10", None, 3600),
            owned("10.0.0.11", "d", "long-gone"),
            owned("10.0.0.12", "d", "e"),
            owned("10.0.0.13", "d", "e"),
        ];
        let decision = decide(&services, &ips);
        let changes: Vec<_> = decision
            .findings
            .iter()
            .map(|f| {
                let change = f.change();
                (
                    f.problem.drift_kind(),
                    change.as_ref().map(|c| c.was.clone()),
                    change.map(|c| c.became),
                )
            })
            .collect();
        let allocated = |ip: &str, owner: &str, family: &str| {
            Some(format!(
                "IPAddress {ip} for Service {owner}, labels ip-family={family} \
                 managed-by=ipallocator.k8s.io"
            ))
        };
        let deleted = Some("deleted".to_owned());
        let expected = [
            (
                "clusterip_not_allocated",
                Some("no IPAddress 10.0.0.5".to_owned()),
                allocated("10.0.0.5", "d/a", "IPv4"),
            ),
            (
                "ipaddress_wrong_reference",
                Some("IPAddress 10.0.0.6 for things.x.io d/t".to_owned()),
                allocated("10.0.0.6", "d/b", "IPv4"),
            ),
            (
                "ipaddress_wrong_labels",
                Some(
                    "IPAddress fd00::5 for Service d/b, labels ip-family=IPv4 \
                     managed-by=ipallocator.k8s.io"
                        .to_owned(),
                ),
                allocated("fd00::5", "d/b", "IPv6"),
            ),
            (
                "ipaddress_wrong_reference",
                Some("IPAddress 10.0.0.7 for Service d/gone, which does not exist".to_owned()),
                allocated("10.0.0.7", "d/c", "IPv4"),
            ),
            ("clusterip_out_of_range", None, None),
            (
                "ipaddress_not_a_service",
                Some("IPAddress 10.0.0.10 with no parent".to_owned()),
                deleted.clone(),
            ),
            (
                "ipaddress_leaked",
                Some(
                    "IPAddress 10.0.0.11 for Service d/long-gone, which does not exist".to_owned(),
                ),
                deleted.clone(),
            ),
            (
                "ipaddress_wrong_parent",
                Some("IPAddress 10.0.0.13 for Service d/e, which does not list it".to_owned()),
                deleted,
            ),
        ];
        let mut got = changes.clone();
        let mut want = expected.to_vec();
        got.sort();
        want.sort();
        assert_eq!(got, want, "{changes:#?}");
    }

    #[test]
    fn no_service_cidr_means_everything_is_out_of_range() {
        let decision =
            decide_ipaddress_mode(&[svc("d", "a", &["10.0.0.5"])], &[], &[], now(), GRACE);
        assert_eq!(
            decision.findings[0].problem.drift_kind(),
            "clusterip_out_of_range"
        );
    }

    fn configured() -> Vec<ServiceRange> {
        vec![
            ServiceRange::new("10.0.0.0/24".parse().unwrap()),
            ServiceRange::new("fd00::/64".parse().unwrap()),
        ]
    }

    /// A duplicate names the Service holding the IP first (by key), which the live read before
    /// the report checks too; an IP listed twice by one Service names no other.
    #[test]
    fn a_duplicate_names_the_first_holder() {
        let services = [
            svc("d", "b", &["10.0.0.5"]),
            svc("d", "a", &["10.0.0.5"]),
            svc("d", "c", &["10.0.0.6", "10.0.0.6"]),
        ];
        let ips = [owned("10.0.0.5", "d", "a"), owned("10.0.0.6", "d", "c")];
        let ipaddress_mode = decide(&services, &ips).findings;
        let audit = decide_audit_mode(&services, &configured()).findings;
        for findings in [ipaddress_mode, audit] {
            let duplicates: Vec<_> = findings
                .iter()
                .filter(|f| f.problem == Problem::AlreadyAllocated)
                .map(|f| {
                    let other = f.shared_with.as_ref().map(|other| {
                        (
                            other.ip.to_string(),
                            other.service.namespace.to_string(),
                            other.service.name.to_string(),
                            other.service.uid.to_string(),
                        )
                    });
                    (f.regarding.object(), other)
                })
                .collect();
            assert!(
                duplicates.contains(&(
                    "Service/d/b".to_owned(),
                    Some((
                        "10.0.0.5".to_owned(),
                        "d".to_owned(),
                        "a".to_owned(),
                        "uid-d-a".to_owned()
                    ))
                )),
                "{duplicates:?}"
            );
            assert!(
                duplicates
                    .iter()
                    .all(|(object, other)| object != "Service/d/c" || other.is_none()),
                "{duplicates:?}"
            );
        }
    }

    #[test]
    fn audit_reports_legacy_reasons() {
        let services = [
            svc("a", "one", &["10.0.0.5", "fd00::5"]),
            svc("a", "two", &["10.0.0.5"]),
            svc("b", "bad", &["nope"]),
            svc("b", "far", &["10.9.0.1"]),
            svc("c", "ok", &["fd00::ffff:1"]),
        ];
        let audit = decide_audit_mode(&services, &configured());
        let got: Vec<_> = audit
            .findings
            .iter()
            .map(|f| {
                (
                    f.regarding.object(),
                    f.problem.event().unwrap().0,
                    f.note.clone(),
                    f.problem.error_type(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "Service/a/two".to_owned(),
                    "ClusterIPAlreadyAllocated",
                    "Cluster IP [IPv4]:10.0.0.5 was assigned to multiple services; please recreate service".to_owned(),
                    Some("duplicate")
                ),
                (
                    "Service/b/bad".to_owned(),
                    "ClusterIPNotValid",
                    "Cluster IP nope is not a valid IP; please recreate service".to_owned(),
                    Some("invalid")
                ),
                (
                    "Service/b/far".to_owned(),
                    "ClusterIPOutOfRange",
                    "Cluster IP [IPv4]:10.9.0.1 is not within the service CIDR 10.0.0.0/24; please recreate service".to_owned(),
                    Some("outOfRange")
                ),
            ]
        );
        assert!(audit.findings.iter().all(|f| f.repair == Repair::None));
        assert_eq!(audit.usage[0].allocated, 1);
        assert_eq!(audit.usage[0].free, 253);
        assert_eq!(audit.usage[1].allocated, 2);
    }

    #[test]
    fn audit_reports_unconfigured_family() {
        let only_v4 = [ServiceRange::new("10.0.0.0/24".parse().unwrap())];
        let audit = decide_audit_mode(&[svc("a", "v6", &["fd00::5"])], &only_v4);
        assert_eq!(
            audit.findings[0].note,
            "Cluster IP fd00::5(IPv6) is of ip family that is no longer configured on cluster; please recreate service"
        );
    }
}
