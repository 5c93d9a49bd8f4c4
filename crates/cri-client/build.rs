fn main() {
    println!("cargo:rerun-if-changed=proto/cri.proto");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["proto/cri.proto"], &["proto"])
        .expect("compiling proto/cri.proto (protoc is installed by scripts/install-etcd.sh)");
}
