{{/*
The Deployment of a GPU tier (encoder or language): call with (dict "root" $ "tier" "encoder"
"health" "tandem.v1.Encoder"). Optional: "values" (the tier's values, default
.Values.<tier>), "command" (the `tandem` subcommand, default the tier), "args" (flags
before extraArgs) and "tlsRole" (the internal-TLS role whose Secret the pod mounts, default
the tier): the prefill tier is `tandem language --role prefill` with the language role's
certificate.

Termination, in order (NOTE: the order is what makes a rollout lose no request):
  1. the pod leaves the Service endpoints, and readiness (the service's own health entry,
     NOT_SERVING once it drains) fails;
  2. preStop sleeps preStopSleepS, so the router re-resolves its DNS (dnsRefreshS) and stops
     picking this pod before the process hears anything;
  3. SIGTERM: the service drains for up to drain_timeout_s;
  4. terminationGracePeriodSeconds = preStop + drain + 15 s margin, so SIGKILL never cuts a
     drain short.
*/}}
{{- define "tandem.gpuTier" -}}
{{- $root := .root -}}
{{- $tier := .tier -}}
{{- $v := .values | default (index $root.Values $tier) -}}
{{- $t := $root.Values.transfer -}}
{{- $m := $root.Values.model -}}
{{- $sel := dict "root" $root "tier" $tier -}}
{{- $rdma := eq $t.protocol "rdma" -}}
{{- $grace := add (int $v.preStopSleepS) (int (ceil $v.drainTimeoutS)) 15 -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.fullname" $root }}-{{ $tier }}
  labels:
    {{- include "tandem.tierLabels" $sel | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 10
  strategy:
    type: RollingUpdate
    rollingUpdate:
      {{- toYaml $v.rollingUpdate | nindent 6 }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" $sel | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.tierLabels" $sel | nindent 8 }}
      annotations:
        # A config change rolls the pods (the services read their config at start only).
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- if $rdma }}
        {{- with $t.rdma.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "tandem.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . }}
        {{- end }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if and $rdma $t.rdma.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      terminationGracePeriodSeconds: {{ $grace }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "tandem.podSpread" (dict "root" $root "tier" $tier "spread" $v.spreadAcrossNodes) | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: {{ $tier }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - {{ .command | default $tier }}
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "tandem.fullname" $root }}-{{ $tier }}
          env:
            # Peers write to / handshake with this address: it must be the pod IP.
            - name: TANDEM_TRANSFER__HOST
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: HOME
              value: /tmp
            {{- include "tandem.internalTLSEnv" (dict "root" $root "role" $tier) | nindent 12 }}
            {{- include "tandem.tracingEnv" (dict "root" $root "role" $tier) | nindent 12 }}
            {{- if $root.Values.internalTLS.enabled }}
            - name: TANDEM_HEALTH_PORT
              value: {{ $root.Values.internalTLS.healthPort | quote }}
            {{- end }}
            - name: HF_HOME
              value: /cache/huggingface
            {{- if $m.hfTokenSecret }}
            - name: HF_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ $m.hfTokenSecret }}
                  key: HF_TOKEN
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
            {{- if $root.Values.internalTLS.enabled }}
            - name: health
              containerPort: {{ $root.Values.internalTLS.healthPort }}
              protocol: TCP
            {{- end }}
          # Startup/readiness ask for the service's own health entry (SERVING once the model
          # is loaded, NOT_SERVING while draining); liveness asks for the server as a whole.
          # Under internal mTLS they ask the plaintext health-only port (a kubelet gRPC
          # probe cannot present a client certificate).
          {{- $probePort := ternary $root.Values.internalTLS.healthPort $v.port $root.Values.internalTLS.enabled }}
          startupProbe:
            grpc:
              port: {{ $probePort }}
              service: {{ .health }}
            periodSeconds: 10
            failureThreshold: {{ $v.startupFailureThreshold }}
          readinessProbe:
            grpc:
              port: {{ $probePort }}
              service: {{ .health }}
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 2
          livenessProbe:
            grpc:
              port: {{ $probePort }}
              service: ""
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          lifecycle:
            preStop:
              exec:
                command: ["sleep", "{{ $v.preStopSleepS }}"]
          resources:
            {{- $res := deepCopy $v.resources }}
            {{- $req := default (dict) $res.requests }}
            {{- $lim := default (dict) $res.limits }}
            {{- if gt (int $v.gpus) 0 }}
            {{- $_ := set $req $v.gpuResource (int $v.gpus) }}
            {{- $_ := set $lim $v.gpuResource (int $v.gpus) }}
            {{- end }}
            {{- if $rdma }}
            {{- range $name, $n := $t.rdma.resources }}
            {{- $_ := set $req $name $n }}
            {{- $_ := set $lim $name $n }}
            {{- end }}
            {{- end }}
            {{- with $req }}
            requests:
              {{- toYaml . | nindent 14 }}
            {{- end }}
            {{- with $lim }}
            limits:
              {{- toYaml . | nindent 14 }}
            {{- end }}
          securityContext:
            {{- $sc := deepCopy $root.Values.securityContext }}
            {{- if $rdma }}
            {{- /* RDMA registers (pins) the transfer buffers: needs a memlock beyond the default. */}}
            {{- $caps := default (dict) $sc.capabilities }}
            {{- $_ := set $caps "add" (append (default (list) $caps.add) "IPC_LOCK") }}
            {{- $_ := set $sc "capabilities" $caps }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: shm
              mountPath: /dev/shm
            - name: hf-cache
              mountPath: /cache
            {{- include "tandem.internalTLSMount" (dict "root" $root) | nindent 12 }}
            {{- if ne $m.source "huggingface" }}
            - name: model
              mountPath: {{ $m.mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        {{- include "tandem.internalTLSVolume" (dict "root" $root "role" (.tlsRole | default $tier)) | nindent 8 }}
        - name: tmp
          emptyDir: {}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSize }}
        - name: hf-cache
          emptyDir:
            {{- if eq $m.source "huggingface" }}
            sizeLimit: {{ $m.hfCacheSizeLimit }}
            {{- else }}
            sizeLimit: 1Gi
            {{- end }}
        {{- if eq $m.source "pvc" }}
        - name: model
          persistentVolumeClaim:
            claimName: {{ $m.claimName }}
            readOnly: true
        {{- else if eq $m.source "hostPath" }}
        - name: model
          hostPath:
            path: {{ $m.hostPath }}
            type: Directory
        {{- end }}
{{- end -}}
