//! The API's OpenAPI document, generated from the handlers' `#[utoipa::path]` attributes and
//! the request and response types (`utoipa::ToSchema`), served at `/v1/openapi.json` and
//! committed as `crates/strata-daemon/openapi.json` (a test fails when the two differ;
//! `STRATA_UPDATE_OPENAPI=1 cargo test -p strata-daemon openapi` rewrites the file).
//!
//! Every operation with a security requirement also answers the API's error body for the
//! usual refusals (400, 401, 403, 404, 409, 500), added here rather than on each handler.

use std::sync::OnceLock;

use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, Schema, SchemaFormat, SchemaType, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, RefOr, Response, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use crate::api::*;
use crate::{relay_api, routes, template_api, tenants, tokens, workspace_api};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "strata",
        version = "1",
        description = "Durable, forkable, object-storage-backed disks for agent sandboxes. Every \
                       tenant route needs `Authorization: Bearer TOKEN`; another tenant's data \
                       answers 404. Errors are `ErrorBody`; every response carries `x-request-id`."
    ),
    paths(
        routes::health,
        routes::openapi_json,
        routes::metrics,
        routes::list_nodes,
        routes::run_gc,
        routes::create_tenant,
        tenants::list_tenants,
        tenants::delete_tenant,
        tokens::list_tenant_tokens,
        tokens::create_tenant_token,
        tokens::revoke_tenant_token,
        tokens::list_own,
        tokens::create_own,
        tokens::revoke_own,
        tenants::set_quotas,
        tenants::usage,
        routes::list_templates,
        routes::show_template,
        routes::delete_template,
        template_api::upload_template,
        template_api::import_template,
        workspace_api::list_workspaces,
        workspace_api::create_workspace,
        workspace_api::show_workspace,
        workspace_api::delete_workspace,
        workspace_api::attach,
        workspace_api::detach,
        workspace_api::checkpoint,
        workspace_api::fork,
        workspace_api::rollback,
        workspace_api::resize,
        workspace_api::log,
        workspace_api::expire_checkpoint,
        workspace_api::freeze,
        workspace_api::thaw,
        workspace_api::mount,
        workspace_api::umount,
        workspace_api::list_mounts,
        relay_api::list_streams,
        relay_api::create_stream,
        relay_api::list_relay_files,
        relay_api::stream_token,
        relay_api::put_relay_file,
        relay_api::get_relay_file,
    ),
    components(schemas(ErrorBody, ErrorDetail, strata_engine::DurationSchema)),
    modifiers(&Common)
)]
pub struct ApiDoc;

struct Common;

impl Modify for Common {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        let error: Response = ResponseBuilder::new()
            .description("The API's error body: a stable kind, a message, whether a retry may help")
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(utoipa::openapi::Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
            .build();
        components.responses.insert("Error".into(), RefOr::T(error));
        for item in doc.paths.paths.values_mut() {
            for op in [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
            ]
            .into_iter()
            .flatten()
            {
                // An optional JSON body is left out (no Content-Type), never sent as `null`.
                if let Some(RefOr::T(body)) = op.request_body.as_mut() {
                    for c in body.content.values_mut() {
                        let RefOr::T(c) = c else { continue };
                        if let Some(RefOr::T(Schema::OneOf(one))) = &c.schema {
                            let real: Vec<_> = one
                                .items
                                .iter()
                                .filter(|s| !matches!(s, RefOr::T(Schema::Object(o)) if o.schema_type == SchemaType::Type(Type::Null)))
                                .cloned()
                                .collect();
                            if real.len() == 1 && one.items.len() == 2 {
                                c.schema = real.into_iter().next();
                                body.required = Some(utoipa::openapi::Required::False);
                            }
                        }
                    }
                }
                // Bytes travel as bytes: a binary string, not an array of integers.
                let binary = || {
                    Some(RefOr::T(Schema::Object(
                        ObjectBuilder::new()
                            .schema_type(Type::String)
                            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
                            .build(),
                    )))
                };
                if let Some(RefOr::T(body)) = op.request_body.as_mut() {
                    if let Some(RefOr::T(c)) = body.content.get_mut("application/octet-stream") {
                        c.schema = binary();
                    }
                }
                for r in op.responses.responses.values_mut() {
                    if let RefOr::T(r) = r {
                        if let Some(RefOr::T(c)) = r.content.get_mut("application/octet-stream") {
                            c.schema = binary();
                        }
                    }
                }
                if op.security.is_none() {
                    continue;
                }
                // Any request may be refused as invalid, unauthorised, forbidden, naming nothing
                // of the caller's, conflicting, too large (64 KiB for JSON), or while a store or
                // the node's disk is unavailable or full.
                for code in [
                    "400", "401", "403", "404", "409", "413", "500", "503", "507",
                ] {
                    op.responses
                        .responses
                        .entry(code.into())
                        .or_insert_with(|| {
                            RefOr::Ref(utoipa::openapi::Ref::from_response_name("Error"))
                        });
                }
            }
        }
    }
}

/// The document as served (generated once).
pub fn document() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| ApiDoc::openapi().to_pretty_json().unwrap_or_default() + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed document is the generated one (regenerate it with
    /// `STRATA_UPDATE_OPENAPI=1 cargo test -p strata-daemon openapi`).
    #[test]
    fn openapi_committed_document_is_the_generated_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");
        if std::env::var("STRATA_UPDATE_OPENAPI").as_deref() == Ok("1") {
            std::fs::write(path, document()).unwrap();
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == document(),
            "{path} is not what the types generate: run STRATA_UPDATE_OPENAPI=1 cargo test -p strata-daemon openapi"
        );
    }

    /// Every schema a document refers to is in it, and every operation names its responses.
    #[test]
    fn openapi_references_resolve() {
        let doc: serde_json::Value = serde_json::from_str(document()).unwrap();
        let text = document();
        for r in text.split("\"$ref\": \"").skip(1) {
            let r = &r[..r.find('"').unwrap()];
            let mut at = &doc;
            for part in r.trim_start_matches("#/").split('/') {
                at = &at[part];
            }
            assert!(!at.is_null(), "{r} does not resolve");
        }
        assert!(doc["paths"].as_object().unwrap().len() >= 26);
    }
}
