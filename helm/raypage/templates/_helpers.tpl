{{/*
The chart name, overridable with nameOverride.
*/}}
{{- define "raypage.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The RayService's name. KubeRay derives Service names from it (<name>-head-svc, <name>-serve-svc)
and appends suffixes to pod names, so it is kept to 40 characters.
*/}}
{{- define "raypage.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "raypage.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "raypage.selectorLabels" -}}
app.kubernetes.io/name: {{ include "raypage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "raypage.labels" -}}
helm.sh/chart: {{ include "raypage.chart" . }}
{{ include "raypage.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "raypage.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The model name clients pass as "model": the one configured, else the engine's model path (the
server's own default), else the packaged model's name.
*/}}
{{- define "raypage.servedModelName" -}}
{{- .Values.serve.servedModelName | default .Values.engine.model | default "SmolLM2-135M-Instruct" }}
{{- end }}

{{/*
build_app's args: the Serve options, the engine's flat keys and the server settings that are set.
Null values are dropped, so that the app's and the engine's own defaults apply.
*/}}
{{- define "raypage.applicationArgs" -}}
{{- $args := dict }}
{{- range $key, $value := merge (deepCopy .Values.engine) (deepCopy .Values.serve.options) }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $args $key $value }}
{{- end }}
{{- end }}
{{- with .Values.serve.engineConfigFile }}
{{- $_ := set $args "config" . }}
{{- end }}
{{- with .Values.serve.servedModelName }}
{{- $_ := set $args "served_model_name" . }}
{{- end }}
{{- with .Values.serve.apiKey }}
{{- $_ := set $args "api_key" . }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/*
The Ray Serve config (serveConfigV2): one application running cluster.serve_app:build_app.
*/}}
{{- define "raypage.serveConfig" -}}
{{- $application := dict
  "name" .Values.serve.applicationName
  "import_path" "cluster.serve_app:build_app"
  "route_prefix" .Values.serve.routePrefix
  "args" (include "raypage.applicationArgs" . | fromYaml) }}
{{- with .Values.serve.deployments }}
{{- $_ := set $application "deployments" . }}
{{- end }}
{{- toYaml (dict "applications" (list $application)) }}
{{- end }}

{{/*
A Ray pod template, shared by the head and the worker groups. Called with a dict:
  root: the chart's root context; group: head or a workerGroups entry (resources, gpus,
  nodeSelector, tolerations, affinity); containerName; ports: the container's ports (may be empty).
GPUs become nvidia.com/gpu requests and limits, from which KubeRay sets Ray's num-gpus.
*/}}
{{- define "raypage.podTemplate" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- $resources := deepCopy ($group.resources | default dict) }}
{{- if gt (int ($group.gpus | default 0)) 0 }}
{{- $gpus := dict "nvidia.com/gpu" (int $group.gpus) }}
{{- $_ := set $resources "requests" (merge $gpus ($resources.requests | default dict)) }}
{{- $_ := set $resources "limits" (merge (deepCopy $gpus) ($resources.limits | default dict)) }}
{{- end -}}
metadata:
  # Only the stable labels: any change to rayClusterConfig (a chart version label included) makes
  # KubeRay replace the whole Ray cluster.
  labels:
    {{- include "raypage.selectorLabels" $root | nindent 4 }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .containerName }}
      image: {{ include "raypage.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- with $root.Values.env }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .ports }}
      ports:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: shared-memory
          mountPath: /dev/shm
        {{- if include "raypage.modelVolumeSource" $root }}
        - name: model
          mountPath: {{ $root.Values.modelVolume.mountPath }}
          readOnly: {{ $root.Values.modelVolume.readOnly }}
        {{- end }}
  volumes:
    - name: shared-memory
      emptyDir:
        medium: Memory
        sizeLimit: {{ $root.Values.sharedMemorySize }}
    {{- with include "raypage.modelVolumeSource" $root }}
    - name: model
      {{- . | nindent 6 }}
    {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
The model volume's source (a PVC or a hostPath directory), empty when neither is set.
*/}}
{{- define "raypage.modelVolumeSource" -}}
{{- $volume := .Values.modelVolume }}
{{- if and $volume.persistentVolumeClaim $volume.hostPath }}
{{- fail "modelVolume: set persistentVolumeClaim or hostPath, not both" }}
{{- end }}
{{- if $volume.persistentVolumeClaim -}}
persistentVolumeClaim:
  claimName: {{ $volume.persistentVolumeClaim }}
  readOnly: {{ $volume.readOnly }}
{{- else if $volume.hostPath -}}
hostPath:
  path: {{ $volume.hostPath }}
  type: Directory
{{- end }}
{{- end }}

{{/*
`ray start` flags as a one-line mapping: KubeRay wants every value as a string.
*/}}
{{- define "raypage.rayStartParams" -}}
{{- $params := dict }}
{{- range $flag, $value := . }}
{{- $_ := set $params $flag (toString $value) }}
{{- end }}
{{- toJson $params }}
{{- end }}
