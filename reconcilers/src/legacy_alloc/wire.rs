//! What one message from etcd may cost to decode.
//!
//! The client bounds a message's length (`MAX_MESSAGE_BYTES` in `etcd.rs`), not what it decodes
//! into: prost gives every entry of a repeated field (an event of a watch response, a key of a
//! range response) a struct of its own, and an entry of two bytes on the wire takes 88 once
//! decoded (`an_entry_decodes_into_far_more_than_its_bytes` below), so one message of the bounded
//! length could take over 20 MiB. [`BoundedCodec`] counts the top-level fields of
//! each message before prost decodes it, and refuses a message of more than [`MAX_FIELDS`]. The
//! protos keep no repeated field below the top level (`proto/`): what lies below is one struct
//! however often the wire repeats it, and a field the protos leave out is skipped, never kept.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// The most entries (events of a watch response, keys of a range response) a message from etcd
/// may have. etcd sends a watcher at most 1,000 revisions in one response (`watchBatchMaxRevs`
/// in server/storage/mvcc/watchable_store.go), one event each for the one key watched here.
pub const MAX_ENTRIES: usize = 1024;

/// The most top-level fields a message may have: its entries and its own few (a watch response
/// has seven besides its events), each counted, whatever its field.
const MAX_FIELDS: usize = MAX_ENTRIES + 16;

/// Why a message is refused: the same text each time, so a watch refused again and again is
/// warned about once.
const TOO_MANY: &str = "an etcd message of more than 1024 entries was refused";
const MALFORMED: &str = "an etcd message that is not protobuf was refused";

/// prost's codec, with each message's entries counted before it is decoded.
pub struct BoundedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for BoundedCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for BoundedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = BoundedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        BoundedDecoder(ProstDecoder::default())
    }
}

pub struct BoundedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for BoundedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        use bytes::Buf;
        // tonic hands the decoder one whole message in one contiguous buffer.
        if buf.chunk().len() < buf.remaining() {
            return Err(Status::internal("an etcd message arrived in pieces"));
        }
        check(buf.chunk())?;
        self.0.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Refuses a message of more than `MAX_FIELDS` top-level fields, or one that is not a
/// sequence of protobuf fields (a group, which etcd's protos never use, included: prost would
/// skip it and go on decoding what follows).
fn check(mut message: &[u8]) -> Result<(), Status> {
    use prost::encoding::decode_varint;
    let malformed = || Status::internal(MALFORMED);
    let mut fields = 0;
    while !message.is_empty() {
        fields += 1;
        if fields > MAX_FIELDS {
            return Err(Status::out_of_range(TOO_MANY));
        }
        let key = decode_varint(&mut message).map_err(|_| malformed())?;
        let skip = match key & 7 {
            0 => {
                decode_varint(&mut message).map_err(|_| malformed())?;
                0
            }
            1 => 8,
            2 => {
                let len = decode_varint(&mut message).map_err(|_| malformed())?;
                usize::try_from(len).map_err(|_| malformed())?
            }
            5 => 4,
            _ => return Err(malformed()),
        };
        message = message.get(skip..).ok_or_else(malformed)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::legacy_alloc::etcd::pb::etcdserverpb::{RangeResponse, WatchResponse};

    /// A watch response of `events` empty events: field 11, length 0, two bytes each.
    fn empty_events(events: usize) -> Vec<u8> {
        [0x5a, 0x00].repeat(events)
    }

    #[test]
    fn an_entry_decodes_into_far_more_than_its_bytes() {
        let message = empty_events(1000);
        let decoded = WatchResponse::decode(&message[..]).unwrap();
        let held = decoded.events.capacity() * size_of_val(&decoded.events[0]);
        println!(
            "{} bytes on the wire, {held} decoded ({} an event)",
            message.len(),
            size_of_val(&decoded.events[0])
        );
        assert!(held >= 40 * message.len(), "{held}");
    }

    #[test]
    fn a_message_of_more_entries_than_the_bound_is_refused_before_it_is_decoded() {
        // The most entries, beside a header.
        let mut most = [0x0a, 0x00].to_vec();
        most.extend(empty_events(MAX_ENTRIES));
        assert!(check(&most).is_ok());
        let refused = check(&empty_events(MAX_FIELDS + 1)).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::OutOfRange);
        assert_eq!(refused.message(), TOO_MANY);
        // As many keys of a range response: the same.
        assert!(check(&[0x12, 0x00].repeat(MAX_FIELDS + 1)).is_err());
        // What etcd sends decodes as before.
        let answer = RangeResponse {
            kvs: vec![Default::default()],
            count: 1,
            ..Default::default()
        }
        .encode_to_vec();
        assert!(check(&answer).is_ok());
    }

    #[test]
    fn a_message_that_is_not_protobuf_is_refused() {
        // A length past the end, a group (wire type 3), a varint that never ends.
        for message in [&[0x5a, 0x05, 0x00][..], &[0x5b, 0x5c], &[0x08, 0xff]] {
            let refused = check(message).unwrap_err();
            assert_eq!(refused.message(), MALFORMED, "{message:?}");
        }
    }
}
