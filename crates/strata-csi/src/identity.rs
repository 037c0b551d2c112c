//! The Identity service: who this plugin is, what it serves, and whether its daemon answers.

use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::pb::{self, plugin_capability};

pub struct Identity {
    daemon: Daemon,
    controller: bool,
}

impl Identity {
    pub fn new(daemon: Daemon, controller: bool) -> Identity {
        Identity { daemon, controller }
    }
}

#[tonic::async_trait]
impl pb::identity_server::Identity for Identity {
    async fn get_plugin_info(
        &self,
        _: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        Ok(Response::new(pb::GetPluginInfoResponse {
            name: crate::DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        let mut capabilities = Vec::new();
        if self.controller {
            capabilities.push(pb::PluginCapability {
                r#type: Some(plugin_capability::Type::Service(
                    plugin_capability::Service {
                        r#type: plugin_capability::service::Type::ControllerService as i32,
                    },
                )),
            });
        }
        // Volumes grow while published: the node grows a mounted filesystem.
        capabilities.push(pb::PluginCapability {
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: plugin_capability::volume_expansion::Type::Online as i32,
                },
            )),
        });
        Ok(Response::new(pb::GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    /// Ready when the daemon answers its health check.
    async fn probe(
        &self,
        _: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeResponse>, Status> {
        let ready = self.daemon.health().await.is_ok();
        if !ready {
            return Err(Status::failed_precondition(
                "the strata daemon on this node does not answer",
            ));
        }
        Ok(Response::new(pb::ProbeResponse { ready: Some(true) }))
    }
}
