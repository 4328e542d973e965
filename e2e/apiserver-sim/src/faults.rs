//! Fault injection and the request log.

use std::sync::Mutex;

use rand::Rng;
use serde::{Deserialize, Serialize};

/// The operation a request performs, as in Kubernetes RBAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    Deletecollection,
}

impl Verb {
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::Deletecollection => "deletecollection",
        }
    }
}

/// What an injected fault does.
///
/// JSON shape (externally tagged by `type`), e.g. `{"type":"error","code":429,"retryAfterSeconds":1}`,
/// `{"type":"latency","millis":200}`, `{"type":"cutWatchAfterEvents","events":3}`,
/// `{"type":"cutWatchAfter","millis":500}`, `{"type":"watchGone"}`, `{"type":"dropConnection"}`,
/// `{"type":"hang"}`, `{"type":"endlessResponse"}`, `{"type":"hugeWatchEvent","bytes":10485760}`,
/// `{"type":"endlessPages"}`, `{"type":"endlessNewObjects"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum FaultKind {
    /// Answer with this HTTP code and a matching `Status` (500, 503, 429, 409, ...). For 429 and
    /// 503, `retry_after_seconds` sets the `Retry-After` header.
    #[serde(rename_all = "camelCase")]
    Error {
        code: u16,
        #[serde(default)]
        retry_after_seconds: Option<u32>,
    },
    /// Delay the request, then serve it normally.
    Latency { millis: u64 },
    /// End a watch stream (cleanly) after it has sent this many events (bookmarks excluded).
    CutWatchAfterEvents { events: u64 },
    /// End a watch stream (cleanly) after this long.
    CutWatchAfter { millis: u64 },
    /// Answer a watch with an `ERROR` event `410 Expired` ("too old resource version").
    WatchGone,
    /// Close the TCP connection without any response.
    DropConnection,
    /// Read the request and never answer, holding the connection open (a hung server).
    Hang,
    /// Answer 200 with a JSON list whose items never end, streamed as fast as it is read.
    EndlessResponse,
    /// Answer a watch with one event line of this many bytes (a hostile or broken server).
    HugeWatchEvent { bytes: u64 },
    /// Answer a watch with one event line that is JSON but no object of any kind (its `object`
    /// a string): what a restored etcd or a hostile server could send.
    UndecodableWatchEvent,
    /// Answer a LIST with a valid page of new objects of the listed resource (a few, each with
    /// a name never sent before) whose `continue` token is never empty, on every continued
    /// request too: a list that never completes although each page is well formed and small.
    EndlessPages,
    /// Answer a watch with ADDED events of new, valid objects of the watched resource (each
    /// with a name never sent before), streamed without end as fast as they are read: a cluster
    /// whose objects grow without bound although each event is well formed and small.
    EndlessNewObjects,
}

impl FaultKind {
    fn watch_only(&self) -> bool {
        matches!(
            self,
            FaultKind::CutWatchAfterEvents { .. }
                | FaultKind::CutWatchAfter { .. }
                | FaultKind::WatchGone
                | FaultKind::HugeWatchEvent { .. }
                | FaultKind::UndecodableWatchEvent
                | FaultKind::EndlessNewObjects
        )
    }

    fn list_only(&self) -> bool {
        matches!(self, FaultKind::EndlessPages)
    }
}

/// When a rule fires.
///
/// JSON: `{"next":3}` (the next 3 matching requests) or `{"probability":0.5}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Trigger {
    /// The next N matching requests, then the rule is spent.
    Next(u32),
    /// Each matching request with this probability (0.0 to 1.0), until cleared.
    Probability(f64),
}

/// One fault rule. `verb` and `resource` of `None` match everything.
///
/// JSON: `{"verb":"list","resource":"services","fault":{"type":"error","code":503},"trigger":{"next":1}}`.
/// `resource` is the plural (`services`) or `plural.group` (`leases.coordination.k8s.io`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FaultRule {
    #[serde(default)]
    pub verb: Option<Verb>,
    #[serde(default)]
    pub resource: Option<String>,
    /// Only requests whose `User-Agent` contains this (one client among several: a network
    /// partition of one replica).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_agent: Option<String>,
    pub fault: FaultKind,
    pub trigger: Trigger,
}

impl FaultRule {
    /// A rule firing for the next `n` requests matching `verb` and `resource`.
    pub fn next(verb: Option<Verb>, resource: Option<&str>, n: u32, fault: FaultKind) -> Self {
        Self {
            verb,
            resource: resource.map(str::to_string),
            user_agent: None,
            fault,
            trigger: Trigger::Next(n),
        }
    }

    /// A rule firing with probability `p` for requests matching `verb` and `resource`.
    pub fn probability(
        verb: Option<Verb>,
        resource: Option<&str>,
        p: f64,
        fault: FaultKind,
    ) -> Self {
        Self {
            verb,
            resource: resource.map(str::to_string),
            user_agent: None,
            fault,
            trigger: Trigger::Probability(p),
        }
    }

    fn matches(&self, verb: Verb, plural: &str, qualified: &str, user_agent: &str) -> bool {
        self.verb.is_none_or(|v| v == verb)
            && self
                .resource
                .as_deref()
                .is_none_or(|r| r == plural || r == qualified)
            && self
                .user_agent
                .as_deref()
                .is_none_or(|wanted| user_agent.contains(wanted))
    }
}

/// Controls for injected faults. Obtained from `Sim::faults()`.
#[derive(Debug, Default)]
pub struct Faults {
    rules: Mutex<Vec<FaultRule>>,
}

impl Faults {
    /// Adds a rule. Rules are checked in insertion order; every matching rule that fires applies
    /// (e.g. latency and then an error).
    pub fn inject(&self, rule: FaultRule) {
        self.lock().push(rule);
    }

    /// Removes every rule.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// The rules still active.
    pub fn rules(&self) -> Vec<FaultRule> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<FaultRule>> {
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The faults that fire for this request, consuming `Next` budgets.
    pub(crate) fn take(
        &self,
        verb: Verb,
        plural: &str,
        qualified: &str,
        user_agent: &str,
    ) -> Vec<FaultKind> {
        let mut rules = self.lock();
        let mut fired = Vec::new();
        let mut rng = rand::rng();
        rules.retain_mut(|r| {
            if !r.matches(verb, plural, qualified, user_agent)
                || (r.fault.watch_only() && verb != Verb::Watch)
                || (r.fault.list_only() && verb != Verb::List)
            {
                return true;
            }
            match &mut r.trigger {
                Trigger::Next(n) => {
                    if *n > 0 {
                        *n -= 1;
                        fired.push(r.fault.clone());
                    }
                    *n > 0
                }
                Trigger::Probability(p) => {
                    let p = if p.is_finite() {
                        p.clamp(0.0, 1.0)
                    } else {
                        0.0
                    };
                    if rng.random_bool(p) {
                        fired.push(r.fault.clone());
                    }
                    true
                }
            }
        });
        fired
    }
}

/// One served request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestRecord {
    /// RFC 3339 time the request arrived, to the microsecond.
    pub time: String,
    /// `get`, `list`, `watch`, ...; for non-resource paths (discovery, health) the HTTP method.
    pub verb: String,
    /// Resource plural (`services`, `leases`), empty for non-resource paths.
    pub resource: String,
    /// The subresource (`status`), if any.
    #[serde(default)]
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    /// The URL path (for non-resource requests this is what identifies them).
    pub path: String,
    /// HTTP status sent (0 for a dropped connection).
    pub status: u16,
    /// The request's `User-Agent` header.
    pub user_agent: String,
}

/// Entries kept; the oldest are dropped beyond this so a long demo does not grow without bound.
const REQUEST_LOG_CAPACITY: usize = 500_000;

/// The request log.
#[derive(Debug, Default)]
pub(crate) struct RequestLog {
    entries: Mutex<std::collections::VecDeque<RequestRecord>>,
}

impl RequestLog {
    pub fn push(&self, r: RequestRecord) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= REQUEST_LOG_CAPACITY {
            entries.pop_front();
        }
        entries.push_back(r);
    }

    pub fn snapshot(&self) -> Vec<RequestRecord> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    pub fn clear(&self) {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}
