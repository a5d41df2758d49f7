{{/* Names, labels and shared pod pieces. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object-name prefix; tier objects append "-encoder" etc., so keep room for it. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end -}}

{{/* Selector labels of one tier: call with (dict "root" $ "tier" "encoder"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .tier }}
{{- end -}}

{{- define "tandem.tierLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .tier }}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The router's image: the CPU-only `router` build target. */}}
{{- define "tandem.routerImage" -}}
{{- $tag := .Values.image.routerTag | default (printf "%s-router" .Chart.AppVersion) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* Headless Service name of a tier (the router's DNS discovery name). */}}
{{- define "tandem.headlessName" -}}
{{- printf "%s-%s-headless" (include "tandem.fullname" .root) .tier -}}
{{- end -}}

{{/* "name.namespace.svc.domain:port" the router resolves to find a tier's pods. */}}
{{- define "tandem.discovery" -}}
{{- $v := .values | default (index .root.Values .tier) -}}
{{- printf "%s.%s.svc.%s:%d" (include "tandem.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain (int $v.port) -}}
{{- end -}}

{{/*
The prefill tier's values (E/P/D, `prefill.enabled`): `language`'s, with the keys `prefill`
sets merged over them (a map merges key by key, a list or scalar replaces; an empty one
keeps language's), and no HPA (`prefill.replicas`). As YAML: use with `| fromYaml`.
*/}}
{{- define "tandem.prefillValues" -}}
{{- $v := mergeOverwrite (deepCopy .Values.language) (omit (deepCopy .Values.prefill) "enabled") -}}
{{- $_ := set $v "autoscaling" (dict "enabled" false) -}}
{{- toYaml $v -}}
{{- end -}}

{{/*
Refuses E/P/D on GPU pods: `--role prefill|decode` is built for `--tp 1` on the CPU only
(services/language/handoff.py refuse_role), so such pods would exit at start.
*/}}
{{- define "tandem.prefillCheck" -}}
{{- if .Values.prefill.enabled -}}
{{- $p := include "tandem.prefillValues" . | fromYaml -}}
{{- if or (gt (int .Values.language.gpus) 0) (gt (int $p.gpus) 0) -}}
{{- fail "prefill.enabled: the prefill and decode roles run on the CPU only (--tp 1, services/language/handoff.py): set language.gpus=0 (and image.variant=cpu)" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The TANDEM_MODEL value: a Hugging Face id or a path in the model volume. */}}
{{- define "tandem.modelRef" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "huggingface" -}}
{{- required "model.id is required when model.source=huggingface" $m.id -}}
{{- else -}}
{{- if eq $m.source "pvc" }}{{ required "model.claimName is required when model.source=pvc" $m.claimName | trunc 0 }}{{ end -}}
{{- if eq $m.source "hostPath" }}{{ required "model.hostPath is required when model.source=hostPath" $m.hostPath | trunc 0 }}{{ end -}}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.path) | trimSuffix "/" -}}
{{- end -}}
{{- end -}}

{{/*
Extra config fields of a tier as TANDEM_<FIELD> entries. Lists/maps are JSON (what
pydantic-settings parses for complex fields). A key the chart already manages is refused,
so one value never has two sources.
*/}}
{{- define "tandem.extraConfig" -}}
{{- range $k, $v := .config }}
{{- if has $k $.managed }}
{{- fail (printf "%s.config.%s is set by a dedicated chart value; use that instead" $.tier $k) }}
{{- end }}
{{- if or (kindIs "slice" $v) (kindIs "map" $v) }}
TANDEM_{{ upper $k }}: {{ toJson $v | quote }}
{{- else }}
TANDEM_{{ upper $k }}: {{ include "tandem.scalar" $v | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
A scalar as the service expects to read it. NOTE: YAML numbers from values files arrive as
float64, and toString would write 1073741824 as "1.073741824e+09"; whole numbers are
printed as integers.
*/}}
{{- define "tandem.scalar" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* Mooncake settings shared by encoder and language ConfigMaps. */}}
{{- define "tandem.transferConfig" -}}
{{- $t := .Values.transfer -}}
{{- if lt (int $t.maxPort) (int $t.minPort) }}{{ fail "transfer.maxPort must be >= transfer.minPort" }}{{ end -}}
{{- if and (eq $t.protocol "rdma") (not $t.deviceName) }}{{ fail "transfer.deviceName is required when transfer.protocol=rdma" }}{{ end -}}
TANDEM_TRANSFER__PROTOCOL: {{ $t.protocol | quote }}
TANDEM_TRANSFER__DEVICE_NAME: {{ $t.deviceName | quote }}
TANDEM_TRANSFER__METADATA_SERVER: {{ $t.metadataServer | quote }}
TANDEM_TRANSFER__MIN_PORT: {{ include "tandem.scalar" $t.minPort | quote }}
TANDEM_TRANSFER__MAX_PORT: {{ include "tandem.scalar" $t.maxPort | quote }}
TANDEM_TRANSFER__TIMEOUT_S: {{ include "tandem.scalar" $t.timeoutS | quote }}
TANDEM_TRANSFER__PROTECT: {{ $t.protect | quote }}
{{- end -}}

{{- define "tandem.podSpread" -}}
{{- if .spread }}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: kubernetes.io/hostname
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "tandem.selectorLabels" . | nindent 8 }}
{{- end }}
{{- end -}}

{{/*
The Secret holding a role's internal TLS material (ca.crt, tls.crt, tls.key): the one
named in internalTLS.existingSecrets, else the chart's own (written by cert-manager or
generated by the chart's hook Job, templates/internal-tls.yaml).
*/}}
{{- define "tandem.internalTLSSecret" -}}
{{- $name := index .root.Values.internalTLS.existingSecrets .role -}}
{{- if $name -}}{{ $name }}{{- else -}}{{ include "tandem.fullname" .root }}-internal-tls-{{ .role }}{{- end -}}
{{- end }}

{{/*
"true" when the chart has cert-manager issue the internal TLS material
(internalTLS.certManager: true, or "auto" and the cluster serves cert-manager.io/v1), else "".
*/}}
{{- define "tandem.internalTLSCertManager" -}}
{{- $mode := toString .Values.internalTLS.certManager -}}
{{- if or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "cert-manager.io/v1")) -}}
true
{{- end -}}
{{- end }}

{{/*
A container's internal TLS settings: env entries (call with dict "root" "role"); volume
and mount below. Without internalTLS.enabled: --insecure-internal, via the environment.
*/}}
{{- define "tandem.internalTLSEnv" -}}
{{- if .root.Values.internalTLS.enabled }}
- name: TANDEM_INTERNAL_TLS__CA
  value: /etc/tandem/internal/ca.crt
- name: TANDEM_INTERNAL_TLS__CERT
  value: /etc/tandem/internal/tls.crt
- name: TANDEM_INTERNAL_TLS__KEY
  value: /etc/tandem/internal/tls.key
{{- else }}
- name: TANDEM_INSECURE_INTERNAL
  value: "true"
{{- end }}
{{- end }}

{{/*
OpenTelemetry traces (values `tracing`): the standard OTEL_* variables every tier reads
(tandem/tracing.py; the service name stays the tier's own, tandem-<tier>). Call with
(dict "root" $ "role" "encoder").
*/}}
{{- define "tandem.tracingEnv" -}}
{{- $t := .root.Values.tracing }}
{{- if $t.enabled -}}
- name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  value: {{ required "tracing.endpoint: the OTLP/gRPC collector (http://host:4317) is required when tracing.enabled" $t.endpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $t.sampler | quote }}
{{- if ne $t.samplerArg nil }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $t.samplerArg | toString | quote }}
{{- end }}
- name: OTEL_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.pod.name=$(OTEL_POD_NAME),k8s.namespace.name=%s,tandem.tier=%s%s" .root.Release.Namespace .role (ternary (printf ",%s" $t.resourceAttributes) "" (ne $t.resourceAttributes "")) | quote }}
{{- end }}
{{- end }}

{{- define "tandem.internalTLSMount" -}}
{{- if .root.Values.internalTLS.enabled }}
- name: internal-tls
  mountPath: /etc/tandem/internal
  readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.internalTLSVolume" -}}
{{- if .root.Values.internalTLS.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "tandem.internalTLSSecret" . }}
    defaultMode: 0440  # readable by fsGroup (the pods run as a non-root user)
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end }}

{{/*
Annotations of the internal-TLS hook objects (templates/internal-tls.yaml): run before
every install and upgrade, lower weights first (Argo CD maps these to PreSync hooks and
sync waves); the previous run's objects are deleted before a new one, and all are deleted
once every hook succeeded. The RBAC objects (the right to create Secrets) are deleted when
the hook fails too, so a failed install leaves no such right behind; the Job stays for its
logs. Call with (dict "weight" N "rbac" true|false).
*/}}
{{- define "tandem.internalTLSHook" -}}
helm.sh/hook: pre-install,pre-upgrade
helm.sh/hook-weight: {{ .weight | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded{{ if .rbac }},hook-failed{{ end }}
{{- end }}
