//! The HTTP surface. Each resource module owns its handlers; `router` merges
//! them into one axum `Router` and derives the OpenAPI document from the same
//! handler annotations, so the contract cannot drift from the code.

mod admin;
mod extract;
mod messages;
mod ops;
mod protect;
pub mod schema;
mod transcript;
mod users;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use utoipa_swagger_ui::SwaggerUi;

use crate::auth::{self, Access};
use crate::config::Limits;
use crate::domain::UserId;
use crate::error::{ApiError, Problem, PROBLEM_JSON};
use crate::store::Store;
use crate::telemetry;

/// What every handler may use: the store, the limits from configuration,
/// and who may call.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub limits: Limits,
    pub access: Arc<Access>,
}

impl AppState {
    /// A service with no API keys: everything acts for the default tenant.
    pub fn open(store: Arc<dyn Store>, limits: Limits) -> Self {
        Self {
            store,
            limits,
            access: Arc::new(Access::open()),
        }
    }
}

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

/// Adds what every `/v1` operation shares instead of repeating it on each
/// handler: the bearer scheme, and the answers of access control (401 no or
/// unknown key, 403 `/v1/admin` without an admin key, 429 over the key's rate
/// limit) and of an unavailable database (503); and, on every operation that
/// takes a body, the answers of the shared `JsonBody` extractor (413 too
/// large, 415 not JSON). It also types optional headers as plain strings
/// (see [`never_null`]).
struct SharedResponses;

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

fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(messages::append_messages, messages::get_history))
        .routes(routes!(messages::get_message, messages::delete_message))
        .routes(routes!(
            transcript::get_transcript,
            transcript::put_transcript
        ))
        .routes(routes!(admin::purge_expired))
        .routes(routes!(admin::clear_all))
        .routes(routes!(users::list_users))
        .routes(routes!(
            users::user_stats,
            users::user_exists,
            users::clear_user
        ))
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::openapi_document))
        .routes(routes!(ops::metrics))
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

/// The whole service as one axum `Router`: the seam tests drive.
pub fn router(state: AppState) -> Router {
    telemetry::metrics();
    let (routes, _) = api_routes().split_for_parts();
    let limits = state.limits;
    let access = state.access.clone();
    let budgets = Arc::new(protect::Budgets::new(&limits));
    let routes = telemetry::trace_requests(
        routes
            .layer(CatchPanicLayer::custom(protect::panic_response))
            .layer(DefaultBodyLimit::max(limits.max_body_bytes))
            .layer(TimeoutLayer::with_status_code(
                StatusCode::SERVICE_UNAVAILABLE,
                limits.request_timeout,
            ))
            .layer(middleware::from_fn_with_state(access, auth::authorize))
            .layer(middleware::from_fn_with_state(budgets, protect::shed_load))
            .layer(middleware::from_fn(telemetry::record_request))
            .with_state(state),
    );
    outer_layers(Router::new().merge(docs()).fallback_service(routes))
}

/// What wraps every answer, whatever made it: problem+json bodies for bare
/// errors (wrapped from outside so that it sees responses axum finishes
/// last, such as a 405 with its `Allow` header), a 500 for a panic anywhere
/// inside, and the request id, set before anything logs and returned on
/// every response. Public so that a test can wrap a handler of its own.
pub fn outer_layers(router: Router) -> Router {
    router
        .layer(CatchPanicLayer::custom(protect::panic_response))
        .layer(middleware::from_fn(problem_for_bare_errors))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}

/// `/docs`: Swagger UI on `/openapi.json`, its assets compiled into the
/// binary (the crate's vendored copy: nothing is fetched at build or run time).
fn docs() -> Router {
    SwaggerUi::new("/docs")
        .config(
            utoipa_swagger_ui::Config::new(["/openapi.json"])
                // No badge that asks validator.swagger.io about the document.
                .validator_url("none")
                .try_it_out_enabled(true)
                .persist_authorization(true),
        )
        .into()
}

/// Gives a problem+json body to error responses that axum or a layer made
/// bare (unknown route, wrong method, …), keeping their headers (`Allow`).
async fn problem_for_bare_errors(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let status = response.status();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(PROBLEM_JSON.as_bytes()));
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return response;
    }
    let detail = match status {
        StatusCode::NOT_FOUND => {
            format!("nothing lives at {path}; the API is under /v1 and described at /openapi.json")
        }
        StatusCode::SERVICE_UNAVAILABLE if is_write(&method) => {
            "the request took longer than this server allows (CHAT_HISTORY_REQUEST_TIMEOUT), so \
             whether it took effect is unknown; retrying is safe: an append with the same \
             Idempotency-Key is stored once, and saves and deletes are idempotent"
                .into()
        }
        StatusCode::SERVICE_UNAVAILABLE => {
            "the request took longer than this server allows (CHAT_HISTORY_REQUEST_TIMEOUT); retry later".into()
        }
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = response
                .headers()
                .get(header::ALLOW)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            format!("{method} is not allowed on {path}; allowed: {allowed}")
        }
        other => other.canonical_reason().unwrap_or("error").to_string(),
    };
    let mut response = Problem::new(status, detail).into_response_with(response);
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .entry(header::RETRY_AFTER)
            .or_insert(HeaderValue::from_static("1"));
    }
    response
}

/// Whether `method` changes data.
fn is_write(method: &Method) -> bool {
    !(method.is_safe() || method == Method::OPTIONS)
}

/// A `user_id` from the path, or a 400 that says what is wrong with it.
fn user_id(raw: String) -> Result<UserId, ApiError> {
    UserId::parse(raw).map_err(|e| ApiError::invalid_parameter("user_id", e))
}
