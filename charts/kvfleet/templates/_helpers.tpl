{{/*
Names and labels. Every resource is "<fullname>-<component>" (or "<fullname>" for shared ones).
The full name is cut at 45 characters so that the longest name, "<fullname>-tokenizer-metrics",
stays within Kubernetes' 63, and StatefulSet pod names within their 52 + ordinal.
*/}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router") */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of the release's pods, whatever their component (NetworkPolicy peers). */}}
{{- define "kvfleet.releaseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Every label of one component's resources: (dict "ctx" $ "component" "router") */}}
{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ include "kvfleet.chart" .ctx }}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Service names and the addresses other components dial. */}}
{{- define "kvfleet.routerName" -}}{{ include "kvfleet.fullname" . }}-router{{- end }}
{{- define "kvfleet.tokenizerName" -}}{{ include "kvfleet.fullname" . }}-tokenizer{{- end }}
{{- define "kvfleet.engineName" -}}{{ include "kvfleet.fullname" . }}-engine{{- end }}
{{- define "kvfleet.redisName" -}}{{ include "kvfleet.fullname" . }}-redis{{- end }}
{{- define "kvfleet.configName" -}}{{ include "kvfleet.fullname" . }}-config{{- end }}

{{- define "kvfleet.tokenizerAddress" -}}
{{- printf "%s:%d" (include "kvfleet.tokenizerName" .) (int .Values.tokenizer.port) }}
{{- end }}

{{/* The Redis URL when it is not a secret: the bundled instance or external.url. */}}
{{- define "kvfleet.redisUrl" -}}
{{- if .Values.redis.bundled }}
{{- printf "%s://%s:%d/%d" (ternary "rediss" "redis" .Values.redis.tls.enabled) (include "kvfleet.redisName" .) (int .Values.redis.port) (int .Values.redis.database) }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{- define "kvfleet.redisUrlFromSecret" -}}
{{- if and (not .Values.redis.bundled) .Values.redis.external.existingSecret.name }}true{{ end }}
{{- end }}

{{- define "kvfleet.routerSecretName" -}}
{{- printf "%s-router-secret" (include "kvfleet.fullname" .) }}
{{- end }}

{{/* The router credential (kvfleet/runtime/service_auth.py), mounted read-only in routers and engines. */}}
{{- define "kvfleet.routerSecretMount" -}}
- name: router-secret
  mountPath: /etc/kvfleet/router-secret
  readOnly: true
{{- end }}

{{- define "kvfleet.routerSecretVolume" -}}
- name: router-secret
  secret:
    secretName: {{ include "kvfleet.routerSecretName" . }}
    defaultMode: 0440
{{- end }}

{{- define "kvfleet.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "kvfleet.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "kvfleet.apiKeysSecretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey }}{{ else }}api-keys.json{{ end }}
{{- end }}

{{/* The model directory as engines and the tokenizer see it. */}}
{{- define "kvfleet.modelPath" -}}
{{- if eq .Values.model.source "image" }}
{{- .Values.model.image.path }}
{{- else }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.dir }}
{{- end }}
{{- end }}

{{/* Fails rendering with a clear message on values the schema cannot express. */}}
{{- define "kvfleet.validate" -}}
{{- if and (not .Values.redis.bundled) (not .Values.redis.external.url) (not .Values.redis.external.existingSecret.name) }}
{{- fail "redis.bundled=false needs redis.external.url or redis.external.existingSecret.name" }}
{{- end }}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) (not .Values.auth.apiKeys) }}
{{- fail "auth.enabled=true needs auth.apiKeys or auth.existingSecret" }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.source=pvc needs model.pvc.claimName" }}
{{- end }}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) }}
{{- fail "model.source=hostPath needs model.hostPath.path" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled=true needs metrics.enabled=true" }}
{{- end }}
{{- if and .Values.redis.bundled .Values.redis.tls.enabled (not .Values.tls.enabled) }}
{{- fail "redis.tls.enabled=true needs tls.enabled=true (the bundled Redis uses the fleet's certificates)" }}
{{- end }}
{{- if and .Values.tls.enabled (eq .Values.tls.source "certManager") (not .Values.tls.certManager.issuerRef.name) }}
{{- fail "tls.source=certManager needs tls.certManager.issuerRef.name" }}
{{- end }}
{{- if and .Values.tracing.enabled (not .Values.tracing.endpoint) }}
{{- fail "tracing.enabled=true needs tracing.endpoint" }}
{{- end }}
{{- end }}

{{/* terminationGracePeriodSeconds of a component: explicit, or preStop + drain + 15 s. */}}
{{- define "kvfleet.terminationGrace" -}}
{{- if kindIs "invalid" .terminationGracePeriodSeconds }}
{{- add .preStopSleepSeconds .gracePeriodSeconds 15 }}
{{- else }}
{{- .terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/*
Native gRPC probes on the standard health service:
(dict "port" 50050 "service" "kvfleet.v1.Router" "probes" .Values.router.probes)
*/}}
{{- define "kvfleet.grpcProbes" -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  {{- if $.tls }}
  # The kubelet's gRPC probe speaks no TLS: with TLS on, a TCP check (docs/tls.md).
  tcpSocket:
    port: {{ $.port }}
  {{- else }}
  grpc:
    port: {{ $.port }}
    service: {{ $.service }}
  {{- end }}
  {{- toYaml (get $.probes $kind) | nindent 2 }}
{{- end }}
{{- end }}

{{/* preStop: wait for endpoints to drop the pod before SIGTERM starts the drain. */}}
{{- define "kvfleet.lifecycle" -}}
{{- if gt (int .preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .preStopSleepSeconds }}"]
{{- end }}
{{- end }}

{{/* Env of every kvfleet container: pod identity, writable HOME, OpenTelemetry. */}}
{{- define "kvfleet.commonEnv" -}}
{{- $ctx := .ctx -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: HOME
  value: /tmp
{{- if $ctx.Values.tracing.enabled }}
{{- $attrs := dict "k8s.namespace.name" "$(POD_NAMESPACE)" "k8s.pod.name" "$(POD_NAME)" "service.instance.id" "$(POD_NAME)" "service.namespace" $ctx.Release.Name "service.version" $ctx.Chart.AppVersion }}
{{- $attrs = merge (deepCopy $ctx.Values.tracing.resourceAttributes) $attrs }}
{{- $pairs := list }}
{{- range $key := keys $attrs | sortAlpha }}
{{- $pairs = append $pairs (printf "%s=%v" $key (get $attrs $key)) }}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: kvfleet-{{ .component }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_METRICS_EXPORTER
  value: none
- name: OTEL_LOGS_EXPORTER
  value: none
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $ctx.Values.tracing.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $ctx.Values.tracing.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $ctx.Values.tracing.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $ctx.Values.tracing.samplerArg | quote }}
- name: OTEL_PROPAGATORS
  value: tracecontext,baggage
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $pairs | quote }}
{{- end }}
{{- end }}

{{/* The Redis URL env var, from the ConfigMap (envFrom) or, when secret, from the Secret. */}}
{{- define "kvfleet.redisEnv" -}}
{{- if include "kvfleet.redisUrlFromSecret" . }}
- name: KVFLEET_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret.name }}
      key: {{ .Values.redis.external.existingSecret.key }}
{{- end }}
{{- end }}

{{/* Writable scratch space (the root filesystem is read-only). */}}
{{- define "kvfleet.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "kvfleet.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* The model volume (none for model.source=image). */}}
{{- define "kvfleet.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "init" }}
- name: model
  emptyDir: {}
{{- else if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- end }}
{{- end }}

{{- define "kvfleet.modelMount" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* model.source=init: convert the default model into the emptyDir before the service starts. */}}
{{- define "kvfleet.modelInitContainer" -}}
{{- if eq .Values.model.source "init" }}
- name: prepare-model
  image: {{ include "kvfleet.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-m", "engine.models.default_model", "--out", {{ include "kvfleet.modelPath" . | quote }}]
  env:
    - name: HOME
      value: /tmp
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    {{- toYaml .Values.model.init.resources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    {{- with (include "kvfleet.scratchMounts" . | trim) }}{{ . | nindent 4 }}{{ end }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by the kvfleet components: (dict "ctx" $ "c" .Values.router) */}}
{{- define "kvfleet.podCommon" -}}
{{- $ctx := .ctx -}}
serviceAccountName: {{ include "kvfleet.serviceAccountName" $ctx }}
automountServiceAccountToken: {{ $ctx.Values.serviceAccount.automountServiceAccountToken }}
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $ctx.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Pod annotations: (dict "ctx" $ "component" "engine" "extra" .Values.engine.podAnnotations).
checksum/config covers the ConfigMap keys this component reads (the shared ones and its own
KVFLEET_<COMPONENT>_*), so a settings change rolls exactly the pods it concerns.
*/}}
{{- define "kvfleet.podAnnotations" -}}
{{- $data := (fromYaml (include (print .ctx.Template.BasePath "/configmap.yaml") .ctx)).data }}
{{- $own := printf "KVFLEET_%s_" (upper .component) }}
{{- $used := dict }}
{{- range $key, $value := $data }}
{{- $othersKey := or (hasPrefix "KVFLEET_ROUTER_" $key) (hasPrefix "KVFLEET_ENGINE_" $key) }}
{{- if or (hasPrefix $own $key) (not $othersKey) }}
{{- $_ := set $used $key $value }}
{{- end }}
{{- end }}
checksum/config: {{ toJson $used | sha256sum }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* NetworkPolicy rule letting the scrapers in (metrics.enabled only). */}}
{{- define "kvfleet.metricsIngress" -}}
{{- if .Values.metrics.enabled }}
- ports:
    - port: metrics
      protocol: TCP
  {{- with .Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* ---- TLS (docs/tls.md) ---- */}}
{{/* A component's TLS Secret: (dict "ctx" . "component" "engine"). */}}
{{- define "kvfleet.tlsSecretName" -}}
{{- default (printf "%s-%s-tls" (include "kvfleet.fullname" .ctx) .component) (get .ctx.Values.tls.secretNames .component) }}
{{- end }}

{{/* The names a component's certificate carries: its role (what peers verify), its Service. */}}
{{- define "kvfleet.tlsDnsNames" -}}
{{- $service := printf "%s-%s" (include "kvfleet.fullname" .ctx) .component }}
{{- list (printf "kvfleet-%s" .component) $service (printf "%s.%s.svc" $service .ctx.Release.Namespace) (printf "%s.%s.svc.cluster.local" $service .ctx.Release.Namespace) "localhost" | toJson }}
{{- end }}

{{- define "kvfleet.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert-file=/etc/kvfleet/tls/tls.crt
- --tls-key-file=/etc/kvfleet/tls/tls.key
- --tls-ca-file=/etc/kvfleet/tls/ca.crt
{{- end }}
{{- end }}

{{- define "kvfleet.tlsMount" -}}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  mountPath: /etc/kvfleet/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvfleet.tlsVolume" -}}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "kvfleet.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* ---- Redis credentials ---- */}}
{{- define "kvfleet.redisAuthSecretName" -}}
{{- printf "%s-redis-auth" (include "kvfleet.fullname" .) }}
{{- end }}

{{/* The Secret and key routers and engines read the Redis password from ("" when none). */}}
{{- define "kvfleet.redisPasswordSecret" -}}
{{- if .Values.redis.bundled }}
{{- if .Values.redis.auth.enabled }}{{ include "kvfleet.redisAuthSecretName" . }}{{ end }}
{{- else if .Values.redis.external.passwordSecret.name }}
{{- .Values.redis.external.passwordSecret.name }}
{{- end }}
{{- end }}

{{- define "kvfleet.redisPasswordKey" -}}
{{- if .Values.redis.bundled }}password{{ else }}{{ .Values.redis.external.passwordSecret.key }}{{ end }}
{{- end }}

{{/* Where routers and engines find the CA of Redis's certificate ("" when not TLS or the system's). */}}
{{- define "kvfleet.redisCaFile" -}}
{{- if and .Values.redis.bundled .Values.redis.tls.enabled }}/etc/kvfleet/tls/ca.crt
{{- else if and (not .Values.redis.bundled) .Values.redis.external.caSecret.name }}/etc/kvfleet/redis-ca/{{ .Values.redis.external.caSecret.key }}
{{- end }}
{{- end }}

{{- define "kvfleet.redisAccessArgs" -}}
{{- if include "kvfleet.redisPasswordSecret" . }}
- --redis-password-file=/etc/kvfleet/redis-auth/{{ include "kvfleet.redisPasswordKey" . }}
{{- end }}
{{- with include "kvfleet.redisCaFile" . }}
- --redis-ca-file={{ . }}
{{- end }}
{{- end }}

{{- define "kvfleet.redisAccessMounts" -}}
{{- if include "kvfleet.redisPasswordSecret" . }}
- name: redis-auth
  mountPath: /etc/kvfleet/redis-auth
  readOnly: true
{{- end }}
{{- if and (not .Values.redis.bundled) .Values.redis.external.caSecret.name }}
- name: redis-ca
  mountPath: /etc/kvfleet/redis-ca
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvfleet.redisAccessVolumes" -}}
{{- with include "kvfleet.redisPasswordSecret" . }}
- name: redis-auth
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: {{ include "kvfleet.redisPasswordKey" $ }}
        path: {{ include "kvfleet.redisPasswordKey" $ }}
{{- end }}
{{- if and (not .Values.redis.bundled) .Values.redis.external.caSecret.name }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.external.caSecret.name }}
    defaultMode: 0440
{{- end }}
{{- end }}
