//! Compiles the vendored CSI v1 protocol (`proto/csi.proto`, spec v1.12.0) at build time:
//! `protox` parses it in-process (no `protoc`, no network), `tonic-prost-build` generates the
//! messages and both the server traits and the clients.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    let fds = protox::compile(["csi.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
