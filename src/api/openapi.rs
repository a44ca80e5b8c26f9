//! The OpenAPI document: its header (`ApiDoc`), what every `/v1` operation
//! shares (`SharedResponses`), and `openapi_json`, what `chat-history
//! openapi` prints and `/openapi.json` serves. The operations themselves are
//! declared on their handlers.

use utoipa::OpenApi;

use super::api_routes;
use crate::error::{Problem, PROBLEM_JSON};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "chat-history",
        description = "Conversation history for bots and LLM agents: append messages per user, \
read back the recent window for the next model call, count, clear, replace a whole transcript, \
purge what has expired. Every error is an RFC 9457 `application/problem+json` document.",
        license(name = "MIT", identifier = "MIT")
    ),
    tags(
        (name = "messages", description = "Append to and read one user's history."),
        (name = "users", description = "Who has history, how much, and clearing it."),
        (name = "transcripts", description = "A conversation as one document: load it, save it whole."),
        (name = "admin", description = "Bulk deletion within the caller's tenant."),
        (name = "operations", description = "Liveness, readiness, metrics and this document.")
    ),
    components(schemas(Problem))
)]
struct ApiDoc;

/// The document's header, tags and shared schemas, before any operation.
pub(super) fn header() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// Adds what every `/v1` operation shares instead of repeating it on each
/// handler: the bearer scheme, and the answers of access control (401 no or
/// unknown key, 403 `/v1/admin` without an admin key, 429 over the key's rate
/// limit) and of an unavailable database (503); and, on every operation that
/// takes a body, the answers of the shared `JsonBody` extractor (413 too
/// large, 415 not JSON). It also types optional headers as plain strings
/// (see [`never_null`]).
pub(super) struct SharedResponses;

impl utoipa::Modify for SharedResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::path::ParameterIn;
        use utoipa::openapi::security::{
            HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
        };
        use utoipa::openapi::{ContentBuilder, HeaderBuilder, Ref, ResponseBuilder};

        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "An API key from CHAT_HISTORY_API_KEYS, sent as `Authorization: Bearer <key>`. \
                         Needed only when the service has keys configured.",
                    ))
                    .build(),
            ),
        );
        let problem = |description: &str| {
            ResponseBuilder::new().description(description).content(
                PROBLEM_JSON,
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Problem")))
                    .build(),
            )
        };
        let integer_header = |description: &str| {
            HeaderBuilder::new()
                .schema(
                    utoipa::openapi::ObjectBuilder::new()
                        .schema_type(utoipa::openapi::Type::Integer),
                )
                .description(Some(description))
                .build()
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            if !path.starts_with("/v1") {
                continue;
            }
            let admin = path.starts_with("/v1/admin");
            for (operation, is_head) in [
                (&mut item.get, false),
                (&mut item.put, false),
                (&mut item.post, false),
                (&mut item.delete, false),
                (&mut item.head, true),
            ]
            .into_iter()
            .filter_map(|(operation, is_head)| Some((operation.as_mut()?, is_head)))
            {
                // A HEAD answer has no body, so its errors document none.
                let problem = |description: &str| {
                    if is_head {
                        ResponseBuilder::new().description(description)
                    } else {
                        problem(description)
                    }
                };
                for parameter in operation.parameters.iter_mut().flatten() {
                    if parameter.parameter_in == ParameterIn::Header {
                        never_null(parameter);
                    }
                }
                // The key is needed only when the service has keys configured;
                // the empty requirement says an open service takes none.
                operation.security = Some(vec![
                    SecurityRequirement::new("bearer", Vec::<String>::new()),
                    SecurityRequirement::default(),
                ]);
                let responses = &mut operation.responses.responses;
                if operation.request_body.is_some() {
                    responses.insert(
                        "413".into(),
                        problem("Body over `max_body_bytes`").build().into(),
                    );
                    responses.insert("415".into(), problem("Body is not JSON").build().into());
                }
                responses.insert(
                    "401".into(),
                    problem("No API key, or an unknown one")
                        .header(
                            "WWW-Authenticate",
                            HeaderBuilder::new()
                                .schema(
                                    utoipa::openapi::ObjectBuilder::new()
                                        .schema_type(utoipa::openapi::Type::String),
                                )
                                .description(Some("`Bearer realm=\"chat-history\"`"))
                                .build(),
                        )
                        .build()
                        .into(),
                );
                if admin {
                    responses.insert(
                        "403".into(),
                        problem("The key's role is `user`; this needs an `admin` key")
                            .build()
                            .into(),
                    );
                }
                responses.insert(
                    "429".into(),
                    problem("This key is over its rate limit")
                        .header(
                            "Retry-After",
                            integer_header("Seconds to wait before retrying"),
                        )
                        .build()
                        .into(),
                );
                responses.insert(
                    "503".into(),
                    problem(
                        "The database is unavailable, or the request ran past the server's timeout",
                    )
                    .header(
                        "Retry-After",
                        integer_header("Seconds to wait before retrying"),
                    )
                    .build()
                    .into(),
                );
            }
        }
    }
}

/// An optional header is absent or a string: HTTP has no null. utoipa types
/// an `Option<String>` header as `string | null`; generated clients would
/// then accept a null where only a string can be sent.
fn never_null(parameter: &mut utoipa::openapi::path::Parameter) {
    use utoipa::openapi::schema::{Schema, SchemaType, Type};
    use utoipa::openapi::RefOr;
    if let Some(RefOr::T(Schema::Object(object))) = parameter.schema.as_mut() {
        if let SchemaType::Array(types) = &object.schema_type {
            let types: Vec<Type> = types
                .iter()
                .filter(|t| **t != Type::Null)
                .cloned()
                .collect();
            if let [only] = types.as_slice() {
                object.schema_type = SchemaType::Type(only.clone());
            }
        }
    }
}

/// The OpenAPI document, as `chat-history openapi` prints it and
/// `/openapi.json` serves it.
pub fn openapi_json() -> String {
    let (_, mut doc) = api_routes().split_for_parts();
    utoipa::Modify::modify(&SharedResponses, &mut doc);
    doc.to_pretty_json()
        .expect("the OpenAPI document serialises")
        + "\n"
}
