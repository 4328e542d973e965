//! The object store and the watch event log.
//!
//! Objects are kept as their serialized JSON bytes plus the few fields needed to index, select
//! and watch them, so memory stays proportional to the data and a LIST is a concatenation.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use serde_json::Value;

use crate::errors::ApiError;
use crate::meta::{labels_of, metadata_mut};
use crate::resources::{RESOURCES, ResIdx};
use crate::selectors::Labels;

/// Field path (`.spec.holderIdentity`) to the field manager that last set it.
pub type Owners = BTreeMap<String, String>;

/// One stored object.
#[derive(Debug, Clone)]
pub struct Stored {
    pub json: Bytes,
    pub rv: u64,
    pub labels: Arc<Labels>,
    /// Field ownership, tracked only for objects ever written by server-side apply (the only
    /// operation whose outcome depends on it).
    pub owners: Option<Arc<Owners>>,
    /// The protobuf encoding, made on the first protobuf request (most runs never ask) and then
    /// used by every list that returns this version of the object. Inline, not behind an `Arc`:
    /// a LIST page reads it for thousands of objects, and a pointer to chase per object was a
    /// cache miss each, about a quarter of the simulator's CPU per fresh pass of the bench.
    pub protobuf: std::sync::OnceLock<Result<Bytes, String>>,
}

impl Stored {
    /// The object's protobuf bytes (no envelope) for a kind with a protobuf schema.
    pub fn protobuf(&self, kind: &str) -> Result<&[u8], ApiError> {
        match self.protobuf.get_or_init(|| {
            let value: Value = serde_json::from_slice(&self.json).map_err(|e| e.to_string())?;
            crate::protobuf::encode_object(kind, &value)
                .map(Bytes::from)
                .map_err(|e| e.to_string())
        }) {
            Ok(bytes) => Ok(bytes),
            Err(e) => Err(ApiError::internal(e.clone())),
        }
    }

    pub fn value(&self) -> Result<Value, ApiError> {
        serde_json::from_slice(&self.json)
            .map_err(|e| ApiError::internal(format!("stored object is not JSON: {e}")))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One entry of the watch log.
#[derive(Debug)]
pub struct WatchEvent {
    pub rv: u64,
    pub res: ResIdx,
    pub ns: String,
    pub name: String,
    pub kind: EventType,
    pub json: Bytes,
    pub labels: Arc<Labels>,
    /// Labels before this change, so selector watches can turn an update into ADDED/DELETED.
    pub prev_labels: Option<Arc<Labels>>,
    /// The object before this change (for field selectors on non-index paths).
    pub prev_json: Option<Bytes>,
}

pub type Key = (String, String);

/// Everything behind the global lock.
#[derive(Debug)]
pub struct State {
    /// The global resourceVersion: the version of the last write.
    pub rv: u64,
    pub objects: Vec<BTreeMap<Key, Stored>>,
    pub log: VecDeque<Arc<WatchEvent>>,
    /// Highest resourceVersion no longer in the log; watching from before it is `410 Gone`.
    pub compacted_rv: u64,
    pub window: usize,
    pub node_ports: HashSet<u16>,
}

impl State {
    pub fn new(window: usize) -> Self {
        Self {
            rv: 1,
            objects: RESOURCES.iter().map(|_| BTreeMap::new()).collect(),
            log: VecDeque::new(),
            compacted_rv: 1,
            window: window.max(1),
            node_ports: HashSet::new(),
        }
    }

    pub fn get(&self, res: ResIdx, ns: &str, name: &str) -> Option<&Stored> {
        self.objects[res].get(&(ns.to_string(), name.to_string()))
    }

    pub fn contains(&self, res: ResIdx, ns: &str, name: &str) -> bool {
        self.get(res, ns, name).is_some()
    }

    fn push_event(&mut self, ev: WatchEvent) {
        self.log.push_back(Arc::new(ev));
        while self.log.len() > self.window {
            if let Some(old) = self.log.pop_front() {
                self.compacted_rv = old.rv;
            }
        }
    }

    /// Stores `obj` under a new resourceVersion, logs ADDED or MODIFIED, and returns the bytes.
    pub fn commit_put(
        &mut self,
        res: ResIdx,
        ns: &str,
        name: &str,
        mut obj: Value,
    ) -> Result<Bytes, ApiError> {
        self.rv += 1;
        let rv = self.rv;
        metadata_mut(&mut obj).insert("resourceVersion".into(), Value::String(rv.to_string()));
        let json =
            Bytes::from(serde_json::to_vec(&obj).map_err(|e| ApiError::internal(e.to_string()))?);
        let labels = Arc::new(labels_of(&obj));
        let key = (ns.to_string(), name.to_string());
        let owners = self.objects[res].get(&key).and_then(|p| p.owners.clone());
        let prev = self.objects[res].insert(
            key,
            Stored {
                json: json.clone(),
                rv,
                labels: labels.clone(),
                owners,
                protobuf: std::sync::OnceLock::new(),
            },
        );
        let kind = if prev.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.push_event(WatchEvent {
            rv,
            res,
            ns: ns.to_string(),
            name: name.to_string(),
            kind,
            json: json.clone(),
            labels,
            prev_labels: prev.as_ref().map(|p| p.labels.clone()),
            prev_json: prev.map(|p| p.json),
        });
        Ok(json)
    }

    /// Replaces the field ownership of a stored object (no new version: managers are metadata
    /// the simulator does not serialize).
    pub fn set_owners(&mut self, res: ResIdx, ns: &str, name: &str, owners: Owners) {
        if let Some(s) = self.objects[res].get_mut(&(ns.to_string(), name.to_string())) {
            s.owners = Some(Arc::new(owners));
        }
    }

    /// Removes an object without logging its DELETED: what a watcher sees when it lost that
    /// event (a client that could not decode the object drops it, and its cache keeps the object
    /// until it lists again). The resourceVersion advances as the delete's would.
    pub fn remove_unlogged(&mut self, res: ResIdx, ns: &str, name: &str) -> Option<Bytes> {
        let prev = self.objects[res].remove(&(ns.to_string(), name.to_string()))?;
        self.rv += 1;
        Some(prev.json)
    }

    /// Removes an object, logs DELETED (carrying the deletion's resourceVersion, as etcd does),
    /// and returns the removed object's bytes at that version.
    pub fn commit_delete(
        &mut self,
        res: ResIdx,
        ns: &str,
        name: &str,
    ) -> Result<Option<Bytes>, ApiError> {
        let Some(prev) = self.objects[res].remove(&(ns.to_string(), name.to_string())) else {
            return Ok(None);
        };
        self.rv += 1;
        let rv = self.rv;
        let mut obj = prev.value()?;
        metadata_mut(&mut obj).insert("resourceVersion".into(), Value::String(rv.to_string()));
        let json =
            Bytes::from(serde_json::to_vec(&obj).map_err(|e| ApiError::internal(e.to_string()))?);
        self.push_event(WatchEvent {
            rv,
            res,
            ns: ns.to_string(),
            name: name.to_string(),
            kind: EventType::Deleted,
            json: json.clone(),
            labels: prev.labels.clone(),
            prev_labels: Some(prev.labels),
            prev_json: Some(prev.json),
        });
        Ok(Some(json))
    }

    /// Events with a resourceVersion greater than `after`, or `None` if some were compacted away.
    pub fn events_after(&self, after: u64) -> Option<Vec<Arc<WatchEvent>>> {
        if after < self.compacted_rv {
            return None;
        }
        let start = self.log.partition_point(|e| e.rv <= after);
        Some(self.log.range(start..).cloned().collect())
    }
}
