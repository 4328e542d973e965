//! Generates the etcd v3 client (KV.Range, KV.Txn, Watch.Watch) from the trimmed copy of etcd's
//! protos in `proto/`, with `protox` (a protobuf compiler in Rust): building needs no `protoc`.

use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new("proto");
    println!("cargo:rerun-if-changed={}", root.display());
    let files = [
        root.join("etcd/api/mvccpb/kv.proto"),
        root.join("etcd/api/etcdserverpb/rpc.proto"),
    ];
    let descriptors = protox::compile(&files, [root])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_transport(false)
        // Counts a response's entries before it is decoded (`legacy_alloc::wire`).
        .codec_path("crate::legacy_alloc::wire::BoundedCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
